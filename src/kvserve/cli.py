"""`kvserve serve|generate|plan|bench|eval-kv`.  Engine flags are generated from the config
dataclass fields (one field, one flag, one help text); errors print one line naming the flag."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import MISSING, fields
from typing import Any

from kvserve.config import ENGINE_PARTS, EngineConfig, parse_size


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """Flags for every EngineConfig field; MODEL is positional."""
    for _, cls in ENGINE_PARTS:
        group = parser.add_argument_group(cls.__name__)
        for f in fields(cls):
            meta = f.metadata
            default = None if f.default is MISSING else f.default
            if f.name == "model" and positional_model:
                parser.add_argument("model", nargs="?", default=None, help=meta["help"])
                continue
            kwargs: dict[str, Any] = {"help": meta.get("help"), "default": default}
            if f.type in ("bool", bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            elif meta.get("parse") == "size":
                kwargs["type"] = str
            else:
                kwargs["type"] = _type_of(f.type, default)
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
            group.add_argument(_flag(f.name), dest=f.name, **kwargs)


def _type_of(annotation: Any, default: Any) -> type:
    text = str(annotation)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return type(default) if default is not None else str


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig; ValueError names the flag (and the fix)."""
    parts = {}
    for name, cls in ENGINE_PARTS:
        values = {}
        for f in fields(cls):
            value = getattr(args, f.name)
            if f.metadata.get("parse") == "size" and value is not None:
                try:
                    value = parse_size(value)
                except ValueError as exc:
                    raise ValueError(f"{_flag(f.name)}: {exc}") from None
            values[f.name] = value
        parts[name] = cls(**values)
    return EngineConfig(**parts)


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.llm import LLM
    from kvserve.request import SamplingParams

    llm = LLM.from_engine_config(engine_config_from_args(args))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    prompts = args.prompt or ["Write one sentence about the sea."]
    for prompt in prompts:
        if args.chat:
            output = llm.chat([{"role": "user", "content": prompt}], params)
        else:
            output = llm.generate([prompt], params)[0]
        print(output.outputs[0].text, flush=True)
    return 0


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="Generate text offline for one or more prompts.")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="A prompt (repeatable).")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="Wrap each prompt in the model's chat template.")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.set_defaults(func=_cmd_generate)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.server.args import add_server_args

    p = subparsers.add_parser("serve", help="Serve an OpenAI-compatible HTTP API.")
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.server.api_server import run_server

    return run_server(engine_config_from_args(args), args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_serve(subparsers)
    _add_generate(subparsers)
    from kvserve.bench.cli import add_bench_parser
    from kvserve.evaluation.cli import add_eval_parser
    from kvserve.planner.cli import add_plan_parser

    for add in (add_plan_parser, add_bench_parser, add_eval_parser):
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # user errors: config, model path, capacity
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
