"""`kvserve serve|generate|plan|bench|eval-kv`.  Engine flags are generated from the config
dataclass fields (one field, one flag, one help text); errors print one line naming the flag."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field

from kvserve.allocator import reexec_with_allocator
from kvserve.errors import UserInputError
from kvserve.flags import add_engine_args, add_fields, engine_config_from_args, from_args
from kvserve.models.paths import resolve_model_path

# The commands that run an engine in this process: they get tcmalloc (allocator.py).
ENGINE_COMMANDS = ("serve", "generate", "eval-kv")


@dataclass(frozen=True)
class GenerateOptions:
    """`kvserve generate`'s own flags (the engine's come from EngineConfig)."""

    prompt: tuple[str, ...] = field(
        default=(), metadata={"help": "A prompt (repeatable).", "action": "append"}
    )
    chat: bool = field(
        default=True, metadata={"help": "Wrap each prompt in the model's chat template."}
    )
    max_tokens: int = field(default=64, metadata={"help": "Tokens to generate per prompt."})
    temperature: float = field(default=0.0, metadata={"help": "0 is greedy."})
    sampling_seed: int | None = field(default=None, metadata={"help": "Seed of the sampler."})


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.llm import LLM
    from kvserve.request import SamplingParams

    options = from_args(GenerateOptions, args)
    llm = LLM.from_engine_config(engine_config_from_args(args))
    params = SamplingParams(
        temperature=options.temperature, max_tokens=options.max_tokens, seed=options.sampling_seed
    )
    for prompt in options.prompt or ("Write one sentence about the sea.",):
        if options.chat:
            output = llm.chat([{"role": "user", "content": prompt}], params)
        else:
            output = llm.generate([prompt], params)[0]
        print(output.outputs[0].text, flush=True)
    return 0


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="Generate text offline for one or more prompts.")
    add_engine_args(p)
    add_fields(p.add_argument_group("GenerateOptions"), GenerateOptions)
    p.set_defaults(func=_cmd_generate)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.server.args import ServerConfig

    p = subparsers.add_parser("serve", help="Serve an OpenAI-compatible HTTP API.")
    add_engine_args(p)
    add_fields(p.add_argument_group("ServerConfig"), ServerConfig)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.server.api_server import run_server
    from kvserve.server.args import ServerConfig

    return run_server(engine_config_from_args(args), from_args(ServerConfig, args))


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


def _check_engine_args(args: argparse.Namespace) -> None:
    """The engine's flags and the model path, checked before the re-execution with tcmalloc
    and before anything imports torch: a mistyped flag or path is answered in ~0.3 s, where
    it took ~8 s (the whole import, twice)."""
    resolve_model_path(engine_config_from_args(args).load.model)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in ENGINE_COMMANDS:
            _check_engine_args(args)
            if argv is None:  # from the command line only: never re-execute a caller
                reexec_with_allocator()
        return int(args.func(args) or 0)
    except UserInputError as exc:  # a flag, a model file, a capacity the user can change
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left (`kvserve plan ... | head`): not an error
        sys.stderr.close()
        return 141
    except Exception:  # anything else is a bug: say so, with the traceback
        logging.getLogger("kvserve").exception(
            "kvserve %s: internal error (a bug; please report it with this traceback)",
            args.command,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
