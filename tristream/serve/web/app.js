// tristream browser client: mic + camera in, live transcript, streaming answer text + audio out, typed turns.
// WebRTC by default (OpenAI's flow: SDP offer POSTed to /v1/realtime/calls, events on the "oai-events"
// data channel, mic and camera as tracks, the answer as an audio track); WebSocket (docs/protocol.md)
// where the server or the browser has no WebRTC. State is exposed on window.tristream for tests.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const IN_RATE = 24000;          // WebSocket: pcm16 rate we send (OpenAI default)
  const OUT_RATE = 24000;         // WebSocket: pcm16 rate we ask for
  const VOICED_RMS = 0.02;
  const RTC_OPEN_TIMEOUT_MS = 10000;
  const S = window.tristream = {
    connected: false, transport: null, fallback: null, info: null, transcripts: [], answers: [],
    answerStatus: [], errors: [], latencies: [], events: 0, framesSent: 0, audioChunksSent: 0,
    audioSamplesPlayed: 0, audioBuffer: [], remoteVoicedMs: 0, rtc: null, typed: 0,
  };
  let ws = null, pc = null, dc = null, ctx = null, micStream = null, camStream = null, node = null;
  let frameTimer = null, statsTimer = null, remoteTimer = null, sources = [];
  let lastVoicedAt = 0, eosAt = 0, firstText = null, firstAudio = null, playHead = 0;
  let answerEl = null, userEl = null, pending = new Int16Array(0), cancelAsked = false;

  const setStatus = (text, cls) => { const el = $("status"); el.textContent = text; el.className = "status " + cls; };
  const addMsg = (who, text) => {
    const d = document.createElement("div"); d.className = "msg " + who;
    const w = document.createElement("span"); w.className = "who"; w.textContent = who;
    const t = document.createElement("span"); t.className = "text"; t.textContent = text;
    d.append(w, t); $("log").appendChild(d); $("log").scrollTop = 1e9; return d;
  };
  const b64 = (bytes) => { let s = ""; for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000)); return btoa(s); };
  const send = (ev) => {
    if (dc && dc.readyState === "open") dc.send(JSON.stringify(ev));
    else if (ws && ws.readyState === 1) ws.send(JSON.stringify(ev));
  };
  const token = () => $("token").value.trim() || new URLSearchParams(location.hash.slice(1)).get("token") || "";
  const markLatency = (which, ms) => { $(which).textContent = ms.toFixed(0) + " ms"; };

  // ---------------------------------------------------------------- what answers
  function showInfo(info) {
    const b = info.backend, m = b.models || {}, parts = [`backend ${b.family}`];
    if (m.llm) parts.push(`LLM ${m.llm.name}${m.llm.device ? " on " + m.llm.device : ""}`);
    for (const [role, label] of [["asr", "ASR"], ["tts", "TTS"], ["vad", "VAD"], ["vision", "vision"], ["turn", "end of turn"]])
      if (m[role]) parts.push(`${label} ${m[role]}`);
    if (b.family === "echo") parts.push("(a test backend without models: it echoes what it got)");
    parts.push(info.transports.webrtc ? "WebRTC available" : "no WebRTC on this server: WebSocket");
    $("info-text").textContent = parts.join(" · ");
  }

  async function loadInfo() {
    const t = token();
    if (!t) return null;
    try {
      const r = await fetch("/v1/info", { headers: { Authorization: "Bearer " + t } });
      if (!r.ok) { $("info-text").textContent = r.status === 401 ? "the token is not accepted" : `no server info (HTTP ${r.status})`; return null; }
      S.info = await r.json(); showInfo(S.info); return S.info;
    } catch (e) { $("info-text").textContent = "no server info: " + e.message; return null; }
  }

  // ---------------------------------------------------------------- microphone (level; WebSocket: the audio)
  function downsample(f32, from, to) {          // linear interpolation, chunk-local
    if (from === to) return f32;
    const n = Math.floor(f32.length * to / from), out = new Float32Array(n), r = from / to;
    for (let i = 0; i < n; i++) { const x = i * r, j = Math.floor(x), a = x - j; out[i] = f32[j] * (1 - a) + (f32[Math.min(j + 1, f32.length - 1)] * a); }
    return out;
  }

  function onMic(f32) {
    let sum = 0; for (let i = 0; i < f32.length; i++) sum += f32[i] * f32[i];
    const rms = Math.sqrt(sum / f32.length); $("level").value = rms;
    if (rms > VOICED_RMS) lastVoicedAt = performance.now();
    if (S.transport !== "websocket") return;     // WebRTC: the mic track carries the audio
    const d = downsample(f32, ctx.sampleRate, IN_RATE), pcm = new Int16Array(d.length);
    for (let i = 0; i < d.length; i++) pcm[i] = Math.max(-32768, Math.min(32767, Math.round(d[i] * 32767)));
    const merged = new Int16Array(pending.length + pcm.length); merged.set(pending); merged.set(pcm, pending.length);
    const step = IN_RATE / 25;   // 40 ms per message
    let k = 0;
    for (; k + step <= merged.length; k += step) {
      send({ type: "input_audio_buffer.append", audio: b64(new Uint8Array(merged.slice(k, k + step).buffer)),
             capture_ts_us: Math.round((performance.timeOrigin + performance.now()) * 1000) });
      S.audioChunksSent++;
    }
    pending = merged.slice(k);
  }

  async function tapMic() {
    const code = `class Tap extends AudioWorkletProcessor { process(i) { if (i[0] && i[0][0]) this.port.postMessage(i[0][0].slice(0)); return true; } }
                  registerProcessor("tap", Tap);`;
    await ctx.audioWorklet.addModule(URL.createObjectURL(new Blob([code], { type: "text/javascript" })));
    node = new AudioWorkletNode(ctx, "tap");
    node.port.onmessage = (m) => onMic(m.data);
    ctx.createMediaStreamSource(micStream).connect(node);
  }

  // ---------------------------------------------------------------- answer audio
  function playPcm16(bytes) {                    // WebSocket: base64 pcm16 deltas, scheduled back to back
    const pcm = new Int16Array(bytes.buffer, bytes.byteOffset, bytes.byteLength >> 1);
    const buf = ctx.createBuffer(1, pcm.length, OUT_RATE), ch = buf.getChannelData(0);
    for (let i = 0; i < pcm.length; i++) ch[i] = pcm[i] / 32768;
    const src = ctx.createBufferSource(); src.buffer = buf; src.connect(ctx.destination);
    playHead = Math.max(playHead, ctx.currentTime + 0.02); src.start(playHead); playHead += buf.duration;
    sources.push(src); src.onended = () => { sources = sources.filter((s) => s !== src); };
    S.audioSamplesPlayed += pcm.length;
  }

  function stopPlayback() {                      // WebSocket: drop what is scheduled (the server cancelled)
    for (const s of sources) { try { s.stop(); } catch (e) { /* already stopped */ } }
    sources = []; playHead = 0;
  }

  function watchRemote(stream) {                 // WebRTC: the answer track's level, for first audio and the test
    $("answer-audio").srcObject = stream;        // Chromium feeds WebAudio from a remote stream only while it plays
    const an = ctx.createAnalyser(); an.fftSize = 1024;
    ctx.createMediaStreamSource(stream).connect(an);
    const buf = new Float32Array(an.fftSize);
    remoteTimer = setInterval(() => {
      an.getFloatTimeDomainData(buf);
      let sum = 0; for (let i = 0; i < buf.length; i++) sum += buf[i] * buf[i];
      if (Math.sqrt(sum / buf.length) > VOICED_RMS) {
        S.remoteVoicedMs += 20;
        if (firstAudio === null && eosAt) { firstAudio = performance.now() - eosAt; markLatency("lat-audio", firstAudio); }
      }
    }, 20);
  }

  // ---------------------------------------------------------------- server events
  function finishAnswer(response) {
    // cancelled without this page asking: the server's turn detection cut it (the user spoke over it);
    // speech_started may come just before or just after the response.done that ends it
    const status = response.status, reason = (response.status_details || {}).reason;
    let label = status;
    if (status === "cancelled") label = cancelAsked && reason !== "turn_detected" ? "cancelled" : "interrupted";
    S.answerStatus.push(label);
    if (answerEl && label !== "completed") {
      answerEl.classList.add("cut");
      const tag = document.createElement("span"); tag.className = "tag " + label; tag.textContent = label;
      answerEl.querySelector(".who").append(" ", tag);
    }
    answerEl = null; cancelAsked = false; $("cancel").disabled = true;
  }

  function onEvent(ev) {
    S.events++;
    const now = performance.now();
    switch (ev.type) {
      case "session.created":
        S.sessionId = ev.session.id; break;
      case "input_audio_buffer.speech_started":
        stopPlayback(); break;   // barge-in: the server cancels the answer
      case "input_audio_buffer.speech_stopped":
        eosAt = lastVoicedAt || now; firstText = firstAudio = null; break;
      case "conversation.item.input_audio_transcription.delta":
        if (!userEl) userEl = addMsg("user", "");
        userEl.querySelector(".text").textContent += ev.delta; break;   // live partial transcript
      case "conversation.item.input_audio_transcription.completed":
        S.transcripts.push(ev.transcript);
        if (!userEl) userEl = addMsg("user", "");
        userEl.querySelector(".text").textContent = ev.transcript; userEl = null; break;
      case "response.created":
        answerEl = addMsg("assistant", ""); S.answers.push(""); $("cancel").disabled = false; break;
      case "response.text.delta": case "response.audio_transcript.delta":
      case "response.output_text.delta": case "response.output_audio_transcript.delta":
        if (firstText === null && eosAt) { firstText = now - eosAt; markLatency("lat-text", firstText); }
        S.answers[S.answers.length - 1] += ev.delta;
        if (answerEl) answerEl.querySelector(".text").textContent = S.answers[S.answers.length - 1];
        break;
      case "response.audio.delta": {
        if (firstAudio === null && eosAt) { firstAudio = now - eosAt; markLatency("lat-audio", firstAudio); }
        const raw = atob(ev.delta), bytes = new Uint8Array(raw.length);
        for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
        playPcm16(bytes); break;
      }
      case "output_audio_buffer.started": case "output_audio_buffer.stopped": case "output_audio_buffer.cleared":
        S.audioBuffer.push(ev.type.split(".")[1]); break;
      case "response.function_call_arguments.done":
        addMsg("tool", `${ev.name || "function"}(${ev.arguments})`); break;
      case "response.done": {
        const srv = (ev.x_tristream && ev.x_tristream.latency_ms) || {};
        if (srv.eos_to_first_audio_ms !== undefined && srv.eos_to_first_audio_ms !== null)
          $("lat-server").textContent = srv.eos_to_first_audio_ms.toFixed(1) + " ms";
        S.latencies.push({ text_ms: firstText, audio_ms: firstAudio, server: srv, status: ev.response.status });
        finishAnswer(ev.response);
        $("turns").textContent = S.latencies.length; eosAt = 0; break;
      }
      case "error":
        S.errors.push(ev.error); addMsg("error", `${ev.error.code}: ${ev.error.message}`); break;
    }
  }

  // ---------------------------------------------------------------- transports
  function iceGathered(p, ms) {
    if (p.iceGatheringState === "complete") return Promise.resolve();
    return new Promise((res) => {
      const t = setTimeout(res, ms);
      p.addEventListener("icegatheringstatechange", () => { if (p.iceGatheringState === "complete") { clearTimeout(t); res(); } });
    });
  }

  async function connectWebRTC(t) {
    if (!window.RTCPeerConnection) throw new Error("this browser has no WebRTC");
    const info = S.info || await loadInfo();
    if (!info) throw new Error("no server info (token?)");
    const where = info.transports.webrtc;
    if (!where) throw new Error("the server offers no WebRTC (aiortc not installed, or --chat-port -1)");
    pc = new RTCPeerConnection();
    for (const tr of micStream.getAudioTracks()) pc.addTrack(tr, micStream);
    if (camStream) for (const tr of camStream.getVideoTracks()) pc.addTrack(tr, camStream);
    pc.ontrack = (e) => { if (e.track.kind === "audio") watchRemote(e.streams[0] || new MediaStream([e.track])); };
    dc = pc.createDataChannel("oai-events");
    dc.onmessage = (m) => onEvent(JSON.parse(m.data));
    const opened = new Promise((res, rej) => {
      dc.onopen = res;
      setTimeout(() => rej(new Error("the data channel did not open")), RTC_OPEN_TIMEOUT_MS);
    });
    await pc.setLocalDescription(await pc.createOffer());
    await iceGathered(pc, 3000);               // the server takes no trickled candidates: they ride in the offer
    const u = new URL(location.href); u.port = String(where.port); u.pathname = where.path; u.hash = ""; u.search = "";
    const r = await fetch(u.href, { method: "POST", body: pc.localDescription.sdp,
                                    headers: { "Content-Type": "application/sdp", Authorization: "Bearer " + t } });
    if (r.status !== 201) throw new Error(`offer refused: HTTP ${r.status} ${(await r.text()).slice(0, 200)}`);
    await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
    await opened;
    dc.onclose = () => { S.connected = false; setStatus("closed", "off"); };
    pc.onconnectionstatechange = () => { if (pc && pc.connectionState === "failed") { S.connected = false; setStatus("connection failed", "err"); } };
    statsTimer = setInterval(async () => {
      if (!pc) return;
      const st = { packetsSent: 0, packetsReceived: 0, packetsLost: 0, audioEnergy: 0, videoFramesSent: 0 };
      (await pc.getStats()).forEach((s) => {
        if (s.type === "outbound-rtp") { st.packetsSent += s.packetsSent || 0; if (s.kind === "video") st.videoFramesSent += s.framesSent || 0; }
        if (s.type === "inbound-rtp" && s.kind === "audio") {
          st.packetsReceived += s.packetsReceived || 0; st.packetsLost += Math.max(0, s.packetsLost || 0);
          st.audioEnergy += s.totalAudioEnergy || 0;
        }
      });
      S.rtc = st; S.framesSent = st.videoFramesSent;
    }, 500);
  }

  function connectWebSocket(t) {
    const proto = location.protocol === "https:" ? "wss" : "ws";
    return new Promise((res, rej) => {
      ws = new WebSocket(`${proto}://${location.host}/v1/realtime`, ["realtime", "openai-insecure-api-key." + t]);
      ws.onmessage = (m) => onEvent(JSON.parse(m.data));
      ws.onerror = () => { setStatus("connection error", "err"); rej(new Error("WebSocket error")); };
      ws.onclose = (e) => { S.connected = false; setStatus(`closed (${e.code} ${e.reason || ""})`, e.code === 1000 ? "off" : "err"); };
      ws.onopen = () => {
        send({ type: "session.update", session: { input_audio_sample_rate: IN_RATE, output_audio_sample_rate: OUT_RATE } });
        if (camStream) startFrames();
        res();
      };
    });
  }

  function startFrames() {                       // WebSocket: the camera as JPEG frames with capture times
    const video = $("preview"), canvas = document.createElement("canvas");
    const fps = Math.max(1, Math.min(15, Number($("fps").value) || 2));
    frameTimer = setInterval(() => {
      if (!video.videoWidth) return;
      canvas.width = Math.min(640, video.videoWidth);
      canvas.height = Math.round(canvas.width * video.videoHeight / video.videoWidth);
      const ts = Math.round((performance.timeOrigin + performance.now()) * 1000);
      canvas.getContext("2d").drawImage(video, 0, 0, canvas.width, canvas.height);
      canvas.toBlob((blob) => blob && blob.arrayBuffer().then((ab) => {
        send({ type: "tristream.input_video_frame.append", format: "jpeg", capture_ts_us: ts,
               width: canvas.width, height: canvas.height, frame: b64(new Uint8Array(ab)) });
        S.framesSent++;
      }), "image/jpeg", 0.7);
    }, 1000 / fps);
  }

  function closeRtc() {
    if (statsTimer) clearInterval(statsTimer);
    if (remoteTimer) clearInterval(remoteTimer);
    if (dc) dc.close();
    if (pc) pc.close();
    pc = dc = statsTimer = remoteTimer = null;
  }

  async function start() {
    $("start").disabled = true;
    try {
      ctx = new AudioContext();
      micStream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
      if ($("camera").checked) camStream = await navigator.mediaDevices.getUserMedia({ video: { width: 640, height: 480 } });
    } catch (e) { setStatus("no media: " + e.message, "err"); $("start").disabled = false; return; }
    S.mediaAt = performance.now();               // when the microphone started (tests time their speech by it)
    if (camStream) $("preview").srcObject = camStream;
    const t = token();
    await loadInfo();
    setStatus("connecting", "off");
    S.transport = null;
    if ($("mode").value !== "websocket") {
      try { await connectWebRTC(t); S.transport = "webrtc"; } catch (e) { closeRtc(); S.fallback = e.message; }
    } else S.fallback = "WebSocket chosen";
    if (!S.transport) {
      S.transport = "websocket";               // set before the mic tap starts sending
      try { await connectWebSocket(t); } catch (e) { S.transport = null; $("start").disabled = false; return; }
    }
    $("transport").textContent = S.transport === "webrtc" ? "WebRTC" : `WebSocket${S.fallback ? " (" + S.fallback + ")" : ""}`;
    S.connected = true; setStatus("live", "on");
    for (const id of ["stop", "text", "send"]) $(id).disabled = false;
    await tapMic();
  }

  function stop() {
    if (frameTimer) clearInterval(frameTimer);
    if (node) node.disconnect();
    for (const s of [micStream, camStream]) if (s) s.getTracks().forEach((tr) => tr.stop());
    closeRtc();
    if (ws) ws.close(1000, "bye");
    ws = null; S.connected = false; setStatus("disconnected", "off");
    $("start").disabled = false;
    for (const id of ["stop", "text", "send", "cancel"]) $(id).disabled = true;
  }

  $("say").onsubmit = (e) => {                   // a typed turn: a user message, then an answer
    e.preventDefault();
    const text = $("text").value.trim();
    if (!text || !S.connected) return;
    send({ type: "conversation.item.create", item: { type: "message", role: "user", content: [{ type: "input_text", text }] } });
    send({ type: "response.create" });
    addMsg("user", text); $("text").value = ""; S.typed++;
  };
  $("cancel").onclick = () => { cancelAsked = true; send({ type: "response.cancel" }); stopPlayback(); };
  $("start").onclick = start; $("stop").onclick = stop;
  $("token").onchange = loadInfo;
  const t0 = new URLSearchParams(location.hash.slice(1)).get("token"); if (t0) $("token").value = t0;
  loadInfo();
})();
