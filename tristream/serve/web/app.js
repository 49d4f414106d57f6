// tristream browser client: mic + camera in, live transcript, streaming answer text + audio out.
// Speaks the Realtime protocol of docs/protocol.md; state is exposed on window.tristream for tests.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const IN_RATE = 24000;          // pcm16 rate we send (OpenAI default)
  const OUT_RATE = 24000;         // pcm16 rate we ask for
  const VOICED_RMS = 0.02;
  const S = window.tristream = {
    connected: false, transcripts: [], answers: [], errors: [], latencies: [], events: 0,
    framesSent: 0, audioChunksSent: 0, audioSamplesPlayed: 0,
  };
  let ws = null, ctx = null, micStream = null, camStream = null, node = null, frameTimer = null;
  let lastVoicedAt = 0, eosAt = 0, firstText = null, firstAudio = null, playHead = 0;
  let answerEl = null, userEl = null, pending = new Int16Array(0);

  const setStatus = (text, cls) => { const el = $("status"); el.textContent = text; el.className = "status " + cls; };
  const addMsg = (who, text) => {
    const d = document.createElement("div"); d.className = "msg " + who;
    d.innerHTML = `<span class="who">${who}</span><span class="text"></span>`;
    d.querySelector(".text").textContent = text; $("log").appendChild(d); $("log").scrollTop = 1e9; return d;
  };
  const b64 = (bytes) => { let s = ""; for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000)); return btoa(s); };
  const send = (ev) => { if (ws && ws.readyState === 1) ws.send(JSON.stringify(ev)); };

  function downsample(f32, from, to) {          // linear interpolation, chunk-local
    if (from === to) return f32;
    const n = Math.floor(f32.length * to / from), out = new Float32Array(n), r = from / to;
    for (let i = 0; i < n; i++) { const x = i * r, j = Math.floor(x), a = x - j; out[i] = f32[j] * (1 - a) + (f32[Math.min(j + 1, f32.length - 1)] * a); }
    return out;
  }

  function onMic(f32) {
    let sum = 0; for (let i = 0; i < f32.length; i++) sum += f32[i] * f32[i];
    const rms = Math.sqrt(sum / f32.length); $("level").value = rms;
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
    if (rms > VOICED_RMS) lastVoicedAt = performance.now();
  }

  function playPcm16(bytes) {
    const pcm = new Int16Array(bytes.buffer, bytes.byteOffset, bytes.byteLength >> 1);
    const buf = ctx.createBuffer(1, pcm.length, OUT_RATE), ch = buf.getChannelData(0);
    for (let i = 0; i < pcm.length; i++) ch[i] = pcm[i] / 32768;
    const src = ctx.createBufferSource(); src.buffer = buf; src.connect(ctx.destination);
    playHead = Math.max(playHead, ctx.currentTime + 0.02); src.start(playHead); playHead += buf.duration;
    S.audioSamplesPlayed += pcm.length;
  }

  function onEvent(ev) {
    S.events++;
    const now = performance.now();
    switch (ev.type) {
      case "input_audio_buffer.speech_started":
        playHead = 0; break;   // barge-in: the server cancels; we stop scheduling more
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
        answerEl = addMsg("assistant", ""); S.answers.push(""); break;
      case "response.text.delta": case "response.audio_transcript.delta":
        if (firstText === null && eosAt) { firstText = now - eosAt; $("lat-text").textContent = firstText.toFixed(0) + " ms"; }
        S.answers[S.answers.length - 1] += ev.delta;
        if (answerEl) answerEl.querySelector(".text").textContent = S.answers[S.answers.length - 1];
        break;
      case "response.audio.delta": {
        if (firstAudio === null && eosAt) { firstAudio = now - eosAt; $("lat-audio").textContent = firstAudio.toFixed(0) + " ms"; }
        const raw = atob(ev.delta), bytes = new Uint8Array(raw.length);
        for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
        playPcm16(bytes); break;
      }
      case "response.done": {
        const srv = (ev.x_tristream && ev.x_tristream.latency_ms) || {};
        if (srv.eos_to_first_audio_ms !== undefined) $("lat-server").textContent = srv.eos_to_first_audio_ms.toFixed(1) + " ms";
        S.latencies.push({ text_ms: firstText, audio_ms: firstAudio, server: srv, status: ev.response.status });
        $("turns").textContent = S.latencies.length; eosAt = 0; break;
      }
      case "error":
        S.errors.push(ev.error); addMsg("error", `${ev.error.code}: ${ev.error.message}`); break;
    }
  }

  function startCamera() {
    const video = $("preview"), canvas = document.createElement("canvas");
    video.srcObject = camStream;
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

  async function start() {
    $("start").disabled = true;
    try {
      ctx = new AudioContext();
      micStream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
      if ($("camera").checked) camStream = await navigator.mediaDevices.getUserMedia({ video: { width: 640, height: 480 } });
    } catch (e) { setStatus("no media: " + e.message, "err"); $("start").disabled = false; return; }
    const proto = location.protocol === "https:" ? "wss" : "ws";
    const token = $("token").value.trim() || new URLSearchParams(location.hash.slice(1)).get("token") || "";
    ws = new WebSocket(`${proto}://${location.host}/v1/realtime`, ["realtime", "openai-insecure-api-key." + token]);
    ws.onmessage = (m) => onEvent(JSON.parse(m.data));
    ws.onerror = () => setStatus("connection error", "err");
    ws.onclose = (e) => { S.connected = false; setStatus(`closed (${e.code} ${e.reason || ""})`, e.code === 1000 ? "off" : "err"); };
    ws.onopen = async () => {
      S.connected = true; setStatus("live", "on"); $("stop").disabled = false;
      send({ type: "session.update", session: { input_audio_sample_rate: IN_RATE, output_audio_sample_rate: OUT_RATE } });
      const code = `class Tap extends AudioWorkletProcessor { process(i) { if (i[0] && i[0][0]) this.port.postMessage(i[0][0].slice(0)); return true; } }
                    registerProcessor("tap", Tap);`;
      await ctx.audioWorklet.addModule(URL.createObjectURL(new Blob([code], { type: "text/javascript" })));
      node = new AudioWorkletNode(ctx, "tap");
      node.port.onmessage = (m) => onMic(m.data);
      ctx.createMediaStreamSource(micStream).connect(node);
      if (camStream) startCamera();
    };
  }

  function stop() {
    if (frameTimer) clearInterval(frameTimer);
    if (node) node.disconnect();
    for (const s of [micStream, camStream]) if (s) s.getTracks().forEach((t) => t.stop());
    if (ws) ws.close(1000, "bye");
    $("start").disabled = false; $("stop").disabled = true;
  }

  $("start").onclick = start; $("stop").onclick = stop;
  const t = new URLSearchParams(location.hash.slice(1)).get("token"); if (t) $("token").value = t;
})();
