"""Chained block hashes, cache salts and public prefixes: the block hasher.

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

Who holds what: one `BlockHasher` per cache manager, built at start from what every request
shares (block size, the KV dtype's namespace, the public prefixes); `for_request(cache_salt)`
reads a request's salt, once, when the request enters the scheduler, and returns the
request's own `BlockHashes`, which the request keeps (across preemptions) and extends as its
tokens grow.  The cache manager only reads them: no call site can key a salted request's
blocks without its salt, because no hashing method takes a salt.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


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


class BlockHasher:
    """What every request's block hashes share, fixed at start: the block size, the namespace
    of every key (the KV dtype) and the public prefixes.  With `enabled` False (prefix caching
    off) the hashes it makes stay empty: nothing would read them."""

    def __init__(
        self,
        block_size: int,
        namespace: bytes = b"",
        public_prefixes: Sequence[Sequence[int]] = (),
        enabled: bool = True,
    ) -> None:
        self.block_size = block_size
        self.namespace = namespace
        self.public = PublicPrefixes(public_prefixes)
        self.enabled = enabled

    def for_request(self, cache_salt: str | None) -> BlockHashes:
        """A new request's (empty) block hashes.  The only place a cache salt is read: once per
        request, hashed to a fixed-length namespace.  `cache_salt` has no default on purpose:
        a caller states that a request has none."""
        if not self.enabled:
            return BlockHashes(self, self.namespace)
        return BlockHashes(self, salted_namespace(self.namespace, cache_salt))


class BlockHashes:
    """One request's full-block hashes, made by `BlockHasher.for_request` and extended by the
    request's owner as its tokens grow; `keys[i]` and `contents[i]` are block i's pool key and
    content hash, for every full block of the tokens seen so far."""

    def __init__(self, hasher: BlockHasher, salted: bytes) -> None:
        self.hasher = hasher
        self.salted = salted  # the namespace of the blocks after the public ones
        self.keys: list[bytes] = []
        self.contents: list[int] = []
        self.num_public = 0  # leading blocks keyed without the salt
        # the public prefixes still matching; None once a block is not public (or never is)
        self._candidates: list[tuple[int, ...]] | None = None
        if salted != hasher.namespace and hasher.public:
            self._candidates = list(hasher.public.prefixes)

    @property
    def num_unsalted(self) -> int:
        """Leading blocks keyed without a cache salt: all of them for a request without one."""
        return len(self.keys) if self.salted == self.hasher.namespace else self.num_public

    def extend(self, token_ids: Sequence[int]) -> None:
        """Hash every full block of `token_ids` (the request's tokens, of which the blocks
        hashed so far are the start) not hashed yet."""
        if not self.hasher.enabled:
            return
        size = self.hasher.block_size
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
        """The namespace of block [start, end) while the blocks before it were all public."""
        assert self._candidates is not None
        public = self.hasher.public
        self._candidates = public.still_matching(self._candidates, token_ids, start, end)
        if self._candidates:
            self.num_public += 1
            return self.hasher.namespace
        self._candidates = None  # public blocks only ever lead
        return self.salted
