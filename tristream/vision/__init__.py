"""Vision engine: ViT towers (SigLIP, CLIP, Idefics3), VLM connectors, GPU preprocessing,
CUDA-graph buckets by image count, token pruning and modality-aware KV retention."""
