"""The commit record: which checkpoints are committed, kept in etcd and written only fenced.

A manifest in storage says that a checkpoint is complete, not that the writer was still allowed
to write it: a rank 0 paused between its fence check and its manifest (a GC pause, SIGSTOP, an
S3 client retrying a PUT) could commit after a new round had resumed from an older step. So
under the etcd-v3 rendezvous the commit point is one etcd key per checkpoint URL,
``<run prefix>checkpoints/<hash of the URL>``, holding the newest ``keep_checkpoints`` committed
checkpoints (step, writer, fencing token and the manifest's file list with sizes and checksums),
newest commit first.
It is written by one transaction that compares

* the writer's fencing token (``rendezvous.fence.Guard``: the rendezvous state key's revision and
  the node's lease key under ``--recovery restart``, the live quorum key and the worker's lease
  key under ``--recovery live``), so a writer whose round or quorum is over, or whose lease
  ended, cannot write it however long it was paused after its check; and
* the record's own revision, so two writers of one round cannot both commit a step (one winner).

The entries are in commit order, not step order: a run started over (``--no-resume``) into the
same checkpoint dir commits step 5 after an older run's step 100, and it is step 5 that a restart
resumes from. A step committed again under another fencing token (that older run's step 5)
replaces its entry; under the same token it is a conflict (a twin of this writer won).

Readers trust the record: ``CheckpointManager.load`` tries its steps, newest commit first,
verified against the file lists in the record; the manifest in storage (written after the record) is only a fallback for
a job whose etcd has no record (a new etcd). Retention keeps every step in the record.

    record = CommitRecord(fence, "s3://bucket/run")   # fence: a rendezvous.fence.Fence
    entries, _ = record.read()                         # newest first; [] when there is no record
    record.commit({"step": 40, "files": {...}, "writer": "w", ...}, keep=3)  # FencedError, Conflict
"""

from __future__ import annotations

import hashlib
import json
import logging

from elastic_trainer import storage
from elastic_trainer.fence import Fence, FencedError

log = logging.getLogger(__name__)

ATTEMPTS = 5
"""Transactions a commit tries when only unrelated keys changed (a node joined, the quorum was
marked finished) before giving up; each attempt re-checks the fence first."""


class Conflict(Exception):
    """The record already holds this step or a newer one (another writer committed first)."""


def record_key(prefix: str, url: str) -> str:
    """The etcd key of the record of ``url`` (without its userinfo) under the run's key prefix."""
    root = prefix.rstrip("/")
    if root.endswith("/live"):  # the live group's keys sit under <run prefix>live/
        root = root[: -len("/live")]
    url = storage.without_userinfo(url)
    return f"{root}/checkpoints/{hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:24]}"


class CommitRecord:
    """The etcd record of the committed checkpoints of one URL (see the module docstring).

    The record names the URL without its userinfo: whoever reads etcd (every node with the
    run's credentials) must not find the storage keys of a trainer started with
    ``s3://KEY:SECRET@...`` (under torchrun, without ``elastic-train`` to take them out)."""

    def __init__(self, fence: Fence, url: str) -> None:
        self.fence = fence
        self.url = storage.without_userinfo(url)
        self.key = record_key(fence.prefix, url)

    def read(self) -> tuple[list[dict], int]:
        """The committed entries, newest commit first, and the key's mod revision (0 when absent)."""
        key = self.key

        def get(c):
            return c.get(key)

        value, meta = self.fence.etcd.call(get, "checkpoint record read")
        if value is None:
            return [], 0
        try:
            entries = json.loads(value)["entries"]
            if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("step"), int)
                                                        and isinstance(e.get("files"), dict) for e in entries):
                raise ValueError("entries are not a list of {step, files}")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"the checkpoint record at etcd key {key} is malformed ({exc}); delete the key "
                             "to fall back to the manifests in storage") from exc
        return entries, meta.mod_revision

    def commit(self, entry: dict, keep: int) -> str:
        """Add ``entry`` (a manifest: step, files, writer, ...) as the newest, keeping ``keep``
        entries, in one transaction fenced by the fence's token; returns the token.

        Raises ``FencedError`` (from the fence) when the writer's round, quorum or lease is over,
        and ``Conflict`` when ``entry``'s step is already committed under the same fencing token.
        """
        key = self.key
        for _ in range(ATTEMPTS):
            guard = self.fence.guard()  # raises FencedError
            entries, rev = self.read()
            for e in entries:
                if e["step"] == entry["step"] and e.get("fence_token") == guard.token:
                    raise Conflict(f"step-{e['step']} is already committed by {e.get('writer')!r} ({guard.token})")
            older = [e for e in entries if e["step"] != entry["step"]]  # another run's same step: replaced
            body = {"url": self.url, "entries": [{**entry, "fence_token": guard.token}] + older[: keep - 1]}
            value = json.dumps(body, sort_keys=True, default=str)

            def txn(c, guard=guard, rev=rev, value=value):
                t = c.transactions
                compare = [getattr(t, target)(k) == v for k, target, v in guard.compares]
                compare.append(t.create(key) == 0 if rev == 0 else t.mod(key) == rev)
                return c.transaction(compare=compare, success=[t.put(key, value)], failure=[])

            ok, _ = self.fence.etcd.call(txn, "checkpoint commit")
            if ok:
                return guard.token
            log.info("checkpoint commit of step-%d: etcd changed since the fence check; checking again",
                     entry["step"])
        raise FencedError(f"the commit of step-{entry['step']} lost {ATTEMPTS} transactions in a row to "
                          "changes in etcd; not committed")
