"""``corefleet generate`` and ``corefleet chat``: the offline engine (``LLM``) from the command
line, one batch of prompts or an interactive conversation on stdin."""

from __future__ import annotations

import argparse
import sys

from corefleet.engine.engine_args import engine_kwargs_from_args
from corefleet.engine.messages import SamplingParams


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=list(args.stop),
    )


def generate_command(args: argparse.Namespace) -> int:
    from corefleet.engine.frontend.llm import LLM

    llm = LLM(**engine_kwargs_from_args(args))
    params = _params(args)
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        print(completion.text)
        print(
            f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]",
            file=sys.stderr,
        )
    llm.shutdown()
    return 0


def chat_command(args: argparse.Namespace) -> int:
    from corefleet.engine.frontend.llm import LLM

    llm = LLM(**engine_kwargs_from_args(args))
    params = _params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            break
        history.append({"role": "user", "content": line.strip()})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    llm.shutdown()
    return 0
