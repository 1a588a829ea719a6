"""Chained block hashes, cache salts and public prefixes.

A full block's pool key is a chained SHA-256:

    key_i = SHA-256(key_{i-1}, namespace_i, token ids of block i)

so a key identifies the whole prefix up to and including the block: equal keys mean equal KV.
`namespace_i` holds whatever else changes or separates the KV: the KV storage dtype always,
and the request's cache salt for every block from the first one that is not *public* on.
Without public prefixes that is block 0, so two salts never share a block (vLLM's
`cache_salt`); a block lying entirely inside a declared public prefix (a shared system prompt)
is keyed without the salt, so every tenant shares it and nothing after it:

    tokens:   | system prompt (public) ...      | tenant text ...               |
    blocks:   | b0 public | b1 public | b2 part | b3            | b4            |
    salted:   |  no       |  no       |  yes    |  yes          |  yes          |

(b2 holds the end of the system prompt and the start of the tenant text: not public.)
SHA-256, not Python's hash: a collision would hand one tenant's KV to another.

Each block also gets a *content* hash, the chain of its tokens alone (no namespace): the
miss-reason shadow index uses it to see that a block missed under one salt or KV dtype was
cached under another ("isolated").  It only feeds statistics, so it is Python's hash of a tuple
of ints (deterministic across processes, unlike hashes of str or bytes): a collision could only
misname a miss.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """SHA-256 of a parent hash (None for the first block), an extra key and token ids."""
    digest = hashlib.sha256()
    digest.update(parent or b"\x00" * 32)
    digest.update(struct.pack("<I", len(extra_key)))
    digest.update(extra_key)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def salted_namespace(namespace: bytes, cache_salt: str | None) -> bytes:
    """The namespace of a request's non-public blocks: the salt's SHA-256 (fixed length, so no
    salt can forge another dtype's namespace), computed once per request, so that hashing each
    block costs the same whatever the salt's length."""
    if cache_salt is None:
        return namespace
    return namespace + b"\x00salt" + hashlib.sha256(cache_salt.encode()).digest()


class PublicPrefixes:
    """Token-id prefixes whose full blocks are keyed without a cache salt.

    Block i of a request is public when its tokens [0, (i+1) * block_size) equal the start of
    one of the prefixes (so every block before it is public too)."""

    def __init__(self, prefixes: Sequence[Sequence[int]] = ()) -> None:
        self.prefixes = [tuple(p) for p in prefixes if p]

    def __bool__(self) -> bool:
        return bool(self.prefixes)

    def still_matching(
        self, candidates: list[tuple[int, ...]], token_ids: Sequence[int], start: int, end: int
    ) -> list[tuple[int, ...]]:
        """The candidates that also hold token_ids[start:end] at the same place."""
        block = tuple(token_ids[start:end])
        return [p for p in candidates if len(p) >= end and p[start:end] == block]


@dataclass
class BlockHashes:
    """One request's full-block hashes, extended as the request grows (memoized by the cache
    manager until the request's blocks are freed)."""

    block_size: int
    namespace: bytes  # for public blocks (and every block of an unsalted request)
    salted: bytes  # for the rest
    public: PublicPrefixes
    contents: list[int] = field(default_factory=list)  # content hash of each block
    keys: list[bytes] = field(default_factory=list)
    num_public: int = 0  # leading blocks keyed without the salt
    _candidates: list[tuple[int, ...]] | None = None  # prefixes still matching; None: done

    def __post_init__(self) -> None:
        if self.salted != self.namespace and self.public:
            self._candidates = list(self.public.prefixes)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Hash every full block of `token_ids` not hashed yet."""
        size = self.block_size
        keys, contents = self.keys, self.contents
        for i in range(len(keys), len(token_ids) // size):
            start, end = i * size, (i + 1) * size
            tokens = token_ids[start:end]
            namespace = (
                self.salted
                if self._candidates is None
                else self._namespace_of(token_ids, start, end)
            )
            keys.append(hash_block(keys[-1] if i else None, tokens, namespace))
            contents.append(hash((contents[-1] if i else 0, *tokens)))  # the content chain

    def _namespace_of(self, token_ids: Sequence[int], start: int, end: int) -> bytes:
        if self._candidates is not None:
            self._candidates = self.public.still_matching(self._candidates, token_ids, start, end)
            if self._candidates:
                self.num_public += 1
                return self.namespace
            self._candidates = None  # public blocks only ever lead
        return self.salted
