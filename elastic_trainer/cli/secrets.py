"""Secrets stay off command lines and out of the workers' environment.

A command line is readable by every user of the machine (``ps``), and an environment is inherited
by every DataLoader worker and subprocess a worker starts. So the launcher

- refuses an etcd password (``--rdzv-conf password=...``) or storage keys (``s3://KEY:SECRET@...``)
  on its command line, without echoing them (:func:`refuse_command_line_secrets`,
  :func:`refuse_rdzv_password`): they belong in a file only you can read, or the launcher's
  environment;
- moves S3 keys (from an S3 checkpoint URL, or ``AWS_*`` whatever the URL) and ``WANDB_API_KEY`` out
  of the environment its workers inherit into 0600 files in a 0700 folder of their own, named by
  ``AWS_SHARED_CREDENTIALS_FILE`` and ``ELASTIC_TRAINER_WANDB_KEY_FILE``, removes the etcd password
  variable (``ELASTIC_TRAINER_RDZV_PASSWORD``), and removes the folder and puts the storage and W&B
  variables back when the run ends (:func:`handed_over`).

Helper processes (the embedded etcd) get none of it: they start with ``env.helper_environ()``. The
built-in trainer's fork server (``preload.py``), started before the keys move, gets the launcher's
environment without them (:func:`without_secrets`).

docs/security.md tells the whole story; tests/test_security.py checks what a worker can see.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping

from elastic_trainer.cli.usage import UsageError
from elastic_trainer.env import (
    ENV_AWS_ACCESS_KEY_ID,
    ENV_AWS_PROFILE,
    ENV_AWS_SECRET_ACCESS_KEY,
    ENV_AWS_SESSION_TOKEN,
    ENV_AWS_SHARED_CREDENTIALS_FILE,
    ENV_CHECKPOINT_DIR,
    ENV_RDZV_PASSWORD,
    ENV_WANDB_API_KEY,
    ENV_WANDB_KEY_FILE,
)


SECRET_VARIABLES = (ENV_AWS_ACCESS_KEY_ID, ENV_AWS_SECRET_ACCESS_KEY, ENV_AWS_SESSION_TOKEN, ENV_WANDB_API_KEY,
                    ENV_RDZV_PASSWORD, ENV_CHECKPOINT_DIR)
"""The launcher's variables that may hold a secret (the checkpoint URL may hold S3 keys): a worker
never has them in its environment (:func:`handed_over` moves them or gives the URL without keys)."""


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without :data:`SECRET_VARIABLES`: for a process started before :func:`handed_over`
    (the fork server, whose environment every worker forked from it starts with)."""
    return {k: v for k, v in environ.items() if k not in SECRET_VARIABLES}


def refuse_command_line_secrets(argv: list[str]) -> None:
    """``UsageError`` (with the value redacted) when an argument holds storage credentials."""
    from elastic_trainer.storage import has_credentials, redact

    leaked = next((a for a in argv if has_credentials(a)), None)
    if leaked is not None:
        raise UsageError(f"{redact(leaked)!r} holds credentials, which every user of this machine can read on a "
                         f"command line; give the keys in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or the whole "
                         f"checkpoint URL in the launcher's env var {ENV_CHECKPOINT_DIR}")


def refuse_rdzv_password(rdzv_conf: dict[str, str]) -> None:
    """``UsageError`` (without the password) when ``--rdzv-conf`` holds ``password=...``."""
    if rdzv_conf.get("password"):
        raise UsageError("--rdzv-conf password=... would put the etcd password on the command line, which every "
                         "user of this machine can read; give password_file=PATH (a file only you can read) or "
                         f"set {ENV_RDZV_PASSWORD} instead")


@contextlib.contextmanager
def handed_over(checkpoint_url: str) -> Iterator[str]:
    """For the length of a run: the storage keys and the W&B key out of ``os.environ`` into 0600
    files (:func:`hand_over_storage_keys`, :func:`hand_over_wandb_key`); yields the checkpoint URL
    the workers get (without keys). Afterwards the files are removed and the variables put back
    (for callers that run ``cli.main()`` in-process)."""
    from elastic_trainer.rendezvous.options import launcher_password

    # The etcd password variable: read (and kept in this process, for the rendezvous handler) and
    # removed now, under every backend; the etcd-v3 handler would only remove it when it starts.
    launcher_password()
    secrets_dir = tempfile.mkdtemp(prefix="elastic-trainer-secrets-")  # 0700; removed when the run ends
    taken_keys: dict[str, str] = {}
    taken_wandb: dict[str, str] = {}
    try:
        workers_url, taken_keys = hand_over_storage_keys(checkpoint_url, secrets_dir)
        taken_wandb = hand_over_wandb_key(secrets_dir)
        yield workers_url
    finally:
        shutil.rmtree(secrets_dir, ignore_errors=True)
        if taken_keys:
            os.environ.pop(ENV_AWS_SHARED_CREDENTIALS_FILE, None)
            os.environ.update(taken_keys)
        if taken_wandb:
            os.environ.pop(ENV_WANDB_KEY_FILE, None)
            os.environ.update(taken_wandb)


def hand_over_storage_keys(url: str, secrets_dir: str) -> tuple[str, dict[str, str]]:
    """What the workers get for S3 keys: the checkpoint URL without ``KEY:SECRET@``, and the keys
    (from the URL, else ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, whatever
    the URL's protocol) in a 0600 AWS credentials file named by ``AWS_SHARED_CREDENTIALS_FILE``, never
    in their environment (from where they would reach every DataLoader worker and subprocess).
    Returns the URL for them and the variables it took out of ``os.environ`` (to put back when the
    run ends). A URL on another protocol with credentials in it was refused at start
    (``storage.check_credentials``); here it would raise ``StorageError``."""
    from elastic_trainer.storage import split_credentials

    # AWS_* keys move for every checkpoint URL: a run with checkpoints on a path may still read its
    # data from S3 (boto3 and s3fs read the credentials file as well).
    clean, keys = split_credentials(url)  # StorageError for credentials in another protocol's URL
    names = (ENV_AWS_ACCESS_KEY_ID, ENV_AWS_SECRET_ACCESS_KEY, ENV_AWS_SESSION_TOKEN, ENV_AWS_SHARED_CREDENTIALS_FILE)
    taken = {name: os.environ[name] for name in names if name in os.environ}
    from_env = [os.environ.pop(name, None) for name in names[:3]]
    if keys is None and from_env[0] and from_env[1]:
        keys = (from_env[0], from_env[1])
    if keys is None:
        os.environ.update(taken)  # keys from a credentials file or an instance role: nothing to move
        return clean, {}
    lines = [f"[{os.environ.get(ENV_AWS_PROFILE, 'default')}]", f"aws_access_key_id = {keys[0]}",
             f"aws_secret_access_key = {keys[1]}"]
    if from_env[2] and keys == (from_env[0], from_env[1]):
        lines.append(f"aws_session_token = {from_env[2]}")
    path = os.path.join(secrets_dir, "aws-credentials")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.environ[ENV_AWS_SHARED_CREDENTIALS_FILE] = path
    return clean, taken


def hand_over_wandb_key(secrets_dir: str) -> dict[str, str]:
    """Move ``WANDB_API_KEY`` out of the environment the workers inherit (and so every DataLoader
    worker and subprocess) into a 0600 file named by ``env.ENV_WANDB_KEY_FILE``; rank 0 reads it
    when it starts W&B (``metrics.init_wandb``). Returns what it took from ``os.environ``, to put back."""
    key = os.environ.pop(ENV_WANDB_API_KEY, None)
    if not key:
        return {}
    path = os.path.join(secrets_dir, "wandb-api-key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    taken = {ENV_WANDB_API_KEY: key}
    if ENV_WANDB_KEY_FILE in os.environ:
        taken[ENV_WANDB_KEY_FILE] = os.environ[ENV_WANDB_KEY_FILE]
    os.environ[ENV_WANDB_KEY_FILE] = path
    return taken
