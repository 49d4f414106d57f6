"""Speech engine: Whisper (tiny … large-v3) with bucketed graphed encoder, static-KV graphed
decoder, LocalAgreement commit policy and many-stream streaming ASR."""
