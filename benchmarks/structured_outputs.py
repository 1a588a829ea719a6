"""Structured outputs served, with the official `openai` client against `kvserve serve`:

1. Validity: 50 JSON schemas of the kinds APIs use (nested objects, arrays, enums, numbers
   with bounds, optional fields, formats of strings), each asked with
   `response_format: json_schema` at temperature 0 and 0.8: every answer must parse and
   validate against its schema (`jsonschema`), and finish with "stop".
2. Speed: 32 constrained requests (one schema each) against 32 unconstrained ones of the same
   lengths (each asked for exactly the tokens its constrained twin produced, ignore_eos), all
   sent at once, one after the other on the same server: the output-throughput ratio.

    .venv/bin/python benchmarks/structured_outputs.py --out results/structured
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import jsonschema
from openai import AsyncOpenAI
from server_process import KVServer

PROMPT = "Fill in a realistic example record as JSON."
NAMES = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 40}


def _fields(i: int) -> dict[str, Any]:
    """Building blocks that vary with i: every schema mixes a few of them.  Patterns are
    anchored, as APIs write them: JSON Schema's `pattern` matches anywhere in the string, so an
    unanchored one admits any string that contains a match (and a small model fills it up)."""
    enum = {"type": "string", "enum": ["new", "active", "paused", "closed"][: 2 + i % 3]}
    bounded = {"type": "integer", "minimum": i, "maximum": 100 + 7 * i}
    number = {"type": "number", "minimum": -1.5 * i, "maximum": 1000}
    tags = {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 1 + i % 4}
    address = {
        "type": "object",
        "properties": {
            "street": SHORT,
            "city": NAMES,
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["city", "zip"] if i % 2 else ["street", "city", "zip"],
        "additionalProperties": False,
    }
    item = {
        "type": "object",
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "qty": bounded},
        "required": ["sku", "qty"],
        "additionalProperties": False,
    }
    return {
        "name": NAMES,
        "status": enum,
        "count": bounded,
        "score": number,
        "active": {"type": "boolean"},
        "tags": tags,
        "address": address,
        "items": {"type": "array", "items": item, "minItems": 1, "maxItems": 1 + i % 3},
        "note": {"anyOf": [SHORT, {"type": "null"}]},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
    }


def schemas(count: int = 50) -> list[dict[str, Any]]:
    """`count` distinct schemas: 3 to 6 of the blocks each, some optional, some nested one
    level deeper under a key of their own."""
    result = []
    for i in range(count):
        blocks = _fields(i)
        names = list(blocks)
        chosen = [names[(i + k * 3) % len(names)] for k in range(3 + i % 4)]
        chosen = list(dict.fromkeys(chosen))
        properties = {name: blocks[name] for name in chosen}
        required = chosen[: max(1, len(chosen) - i % 3)]  # the rest optional
        schema: dict[str, Any] = {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }
        if i % 5 == 4:  # nested: the record under a key, beside an id
            schema = {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1}, "record": schema},
                "required": ["id", "record"],
                "additionalProperties": False,
            }
        result.append(schema)
    return result


def response_format(index: int, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}}


async def ask(client: AsyncOpenAI, model: str, **kwargs: Any) -> Any:
    return await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=512, **kwargs
    )


async def validity(client: AsyncOpenAI, model: str, all_schemas: list[dict]) -> dict:
    """Every schema at temperature 0 and 0.8 (seeded): parsed, validated, finished."""
    failures, answers = [], 0
    for temperature in (0.0, 0.8):
        replies = await asyncio.gather(*(
            ask(client, model, temperature=temperature, seed=i,
                response_format=response_format(i, schema))
            for i, schema in enumerate(all_schemas)
        ))  # fmt: skip
        for i, (schema, reply) in enumerate(zip(all_schemas, replies, strict=True)):
            answers += 1
            choice = reply.choices[0]
            try:
                jsonschema.validate(json.loads(choice.message.content), schema)
                assert choice.finish_reason == "stop", choice.finish_reason
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                failures.append({"schema": i, "temperature": temperature, "error": str(exc)[:200]})
    return {"answers": answers, "valid": answers - len(failures), "failures": failures}


async def speed(client: AsyncOpenAI, model: str, all_schemas: list[dict], num: int) -> dict:
    """`num` constrained requests at once, then `num` unconstrained ones of the same token
    counts at once; output tokens per second of each and their ratio."""
    picked = all_schemas[:num]
    started = time.perf_counter()
    constrained = await asyncio.gather(*(
        ask(client, model, temperature=0.0, response_format=response_format(i, s))
        for i, s in enumerate(picked)
    ))  # fmt: skip
    constrained_s = time.perf_counter() - started
    lengths = [r.usage.completion_tokens for r in constrained]
    started = time.perf_counter()
    free = await asyncio.gather(*(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=n,
            temperature=0.0, extra_body={"ignore_eos": True, "min_tokens": n},
        )
        for n in lengths
    ))  # fmt: skip
    free_s = time.perf_counter() - started
    assert [r.usage.completion_tokens for r in free] == lengths
    tokens = sum(lengths)
    return {
        "requests": num,
        "output_tokens": tokens,
        "constrained_s": round(constrained_s, 2),
        "unconstrained_s": round(free_s, 2),
        "constrained_tok_s": round(tokens / constrained_s, 1),
        "unconstrained_tok_s": round(tokens / free_s, 1),
        "ratio": round(free_s / constrained_s, 3),
    }


async def run(base_url: str, num: int) -> dict:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600)
    model = (await client.models.list()).data[0].id
    all_schemas = schemas()
    await ask(client, model, response_format=response_format(0, all_schemas[0]))  # warm-up
    report = {"validity": await validity(client, model, all_schemas)}
    report["speed"] = await speed(client, model, all_schemas, num)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/structured"))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--kvserve-args", default="--kv-cache-memory 512MiB --max-model-len 2048")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with KVServer(args.kvserve_args.split(), args.out) as server:
        report = asyncio.run(run(server.base_url, args.num_requests))
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if not report["validity"]["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
