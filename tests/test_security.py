"""Nobody joins a run, reads its secrets or rewrites its state uninvited (docs/security.md).

Against real components: an etcd 3.4 with authentication on, the embedded etcd, the real
``elastic-train`` with a worker script (``tests/helpers/secret_probe.py``) that reports its
environment and every command line of the job's processes, while the test reads the command line
and environment of every process below the launcher (``/proc/<pid>/cmdline``, ``environ``).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic_trainer import cli
from elastic_trainer.etcd import server as etcd_server
from elastic_trainer.cli import launch, secrets
from elastic_trainer.drill.nodes import descendants
from elastic_trainer.env import HELPER_ENV
from elastic_trainer.etcd.server import EtcdServer
from elastic_trainer.rendezvous.options import RendezvousOptions
from tests.helpers.common import REPO, cli_cmd, wait_until
from tests.helpers.runs import TINY

CANARY = "canary-Zq7xW3pL9"  # a password that must never show up where others can read it
WANDB_CANARY = "wandbcanary0123456789abcdef0123456789abcd"  # 40 characters, as W&B's keys
STORAGE_CANARY = "canaryS3secretQ4rT8"  # an S3 secret key, likewise
PROBE = str(REPO / "tests" / "helpers" / "secret_probe.py")


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory):
    """A real etcd with authentication on: user root, password ``CANARY``."""
    data = tmp_path_factory.mktemp("etcd-auth") / "data"
    server = EtcdServer(data_dir=data, log_path=data.with_suffix(".log"))
    server.start()
    try:
        etcd_server.enable_auth(server.endpoint, CANARY)
        yield server
    finally:
        server.stop()


def _secret_file(path: Path, text: str = CANARY, mode: int = 0o600) -> Path:
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def _anonymous(endpoint: str):
    import etcd3

    host, port = endpoint.rsplit(":", 1)
    return etcd3.client(host, int(port), timeout=5)


# -- the launcher refuses to carry a password where others can read it ------------------------------

@pytest.fixture
def nothing_connects(monkeypatch):
    """Fail the test if the launcher gets as far as probing an endpoint or launching."""
    def fail(*args, **kwargs):
        raise AssertionError("reached the network despite bad input")
    monkeypatch.setattr(etcd_server, "probe_endpoint", fail)
    monkeypatch.setattr(launch, "run_node", fail)


def test_a_password_on_the_command_line_is_refused_without_echoing_it(capsys, nothing_connects):
    assert cli.main(["--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf", f"user=root,password={CANARY}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "password_file=PATH" in err and "ELASTIC_TRAINER_RDZV_PASSWORD" in err
    assert CANARY not in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_storage_keys_on_the_command_line_are_refused_without_echoing_them(where, capsys, nothing_connects):
    url = f"s3://AKIDEXAMPLE:{STORAGE_CANARY}@bucket/run"
    argv = ["--checkpoint-dir", url] if where == "before" else ["--", "--checkpoint-dir", url]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "s3://***@bucket/run" in err and "ELASTIC_TRAINER_CHECKPOINT_DIR" in err
    assert STORAGE_CANARY not in err and "AKIDEXAMPLE" not in err


def test_basic_auth_over_plain_http_to_another_host_is_refused_before_connecting(tmp_path, capsys, nothing_connects):
    # etcd.invalid never resolves (RFC 6761), and the check happens before any lookup or connection.
    secret = _secret_file(tmp_path / "pw")
    assert cli.main(["--rdzv-endpoint", "etcd.invalid:2379", "--rdzv-conf", f"user=root,password_file={secret}",
                     "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "plain http to etcd.invalid" in err and "protocol=https" in err
    assert CANARY not in err


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_basic_auth_over_plain_http_to_loopback_is_allowed(tmp_path, host):
    secret = _secret_file(tmp_path / "pw")
    params = RendezvousParameters("etcd-v3", f"{host}:2379", "r", 1, 1, user="root", password_file=str(secret))
    assert RendezvousOptions(params).etcd.password == CANARY


def test_a_password_file_that_others_can_read_is_refused(tmp_path):
    secret = _secret_file(tmp_path / "pw", mode=0o644)
    params = RendezvousParameters("etcd-v3", "127.0.0.1:2379", "r", 1, 1, user="root", password_file=str(secret))
    with pytest.raises(ValueError, match=r"can be read by other users \(mode 644\); run `chmod 600"):
        RendezvousOptions(params)


def test_the_etcd_password_is_never_in_a_repr():
    params = RendezvousParameters("etcd-v3", "127.0.0.1:2379", "r", 1, 1, user="root", password=CANARY)
    assert CANARY not in repr(RendezvousOptions(params).etcd)


# -- end to end: what workers get ---------------------------------------------------------------

def _run_probe(tmp_path: Path, procs, argv: list[str], env: dict[str, str], checkpoint_dir: bool = True):
    """Start ``elastic-train ARGV secret_probe.py``; return (process, probe folder, the probe's report)."""
    out = tmp_path / "probe"
    out.mkdir()
    err = open(tmp_path / "stderr", "w")
    proc = procs.start(cli_cmd("--nnodes", "1", "--nproc-per-node", "1", "--recovery", "restart",
                               "--log-dir", str(tmp_path / "logs"),
                               *(["--checkpoint-dir", str(tmp_path / "ck")] if checkpoint_dir else []), *argv, PROBE),
                       env={**os.environ, **env, "PROBE_OUT": str(out), "PROBE_TEST_PID": str(os.getpid())}, stdout=err, stderr=subprocess.STDOUT)
    err.close()

    def report():
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        path = out / "rank0.json"
        return json.loads(path.read_text()) if path.exists() else None
    return proc, out, wait_until(report, 120, "the probe's report", interval=0.3)


def _finish(proc, out: Path, tmp_path: Path) -> str:
    (out / "stop").touch()
    assert proc.wait(60) == 0, (tmp_path / "stderr").read_text()[-3000:]
    return (tmp_path / "stderr").read_text()


def _files_holding(folder: Path, secret: str) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def _processes_below(launcher_pid: int, secrets_: list[str]) -> dict[int, tuple[bytes, bytes]]:
    """The command line and environment of every process below the launcher (workers, the embedded
    etcd, W&B's service: the launcher's own is the documented exception); fails naming each one
    that holds a secret. Returns ``{pid: (cmdline, environ)}``."""
    seen = {}
    for pid in descendants(launcher_pid):
        try:
            seen[pid] = (Path(f"/proc/{pid}/cmdline").read_bytes(), Path(f"/proc/{pid}/environ").read_bytes())
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
    leaks = [f"{secret!r} in the {what} of {pid} ({cmd[:60]!r})" for pid, (cmd, env) in seen.items()
             for what, blob in (("cmdline", cmd), ("environ", env)) for secret in secrets_ if secret.encode() in blob]
    assert not leaks, f"secrets in processes the launcher started: {leaks}"
    return seen


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_workers_get_files_for_the_etcd_password_and_the_storage_keys_never_the_secrets(
        auth_etcd, s3_url, tmp_path, procs, run_id):
    # Both secrets in the launcher's environment (the password, the checkpoint URL with its S3 key):
    # gone from the workers' environment and from every command line; the workers' fence reaches
    # etcd and rank 0 saves a checkpoint through 0600 files, which are removed when the run ends.
    bucket_path = s3_url.split("://", 1)[1]
    proc, out, report = _run_probe(tmp_path, procs, ["--rdzv-endpoint", auth_etcd.endpoint, "--run-id", run_id,
                                                     "--rdzv-conf", "user=root"],
                                   {"ELASTIC_TRAINER_RDZV_PASSWORD": CANARY, "WANDB_API_KEY": WANDB_CANARY,
                                    "ELASTIC_TRAINER_CHECKPOINT_DIR": f"s3://testing:{STORAGE_CANARY}@{bucket_path}"},
                                   checkpoint_dir=False)
    assert report["fence_error"] is None
    assert any("elastic_trainer.cli" in c for c in report["cmdlines"])
    assert any(b"secret_probe" in cmd for cmd, _ in _processes_below(proc.pid, [CANARY, STORAGE_CANARY,
                                                                                  WANDB_CANARY]).values())
    for secret in (CANARY, STORAGE_CANARY, WANDB_CANARY):
        assert secret not in json.dumps(report["environ"]) and secret not in report["proc_environ"]
        assert not [c for c in report["cmdlines"] if secret in c]
    assert report["environ"]["ELASTIC_TRAINER_CHECKPOINT_DIR"] == f"s3://{bucket_path}"
    conn = json.loads(report["environ"]["ELASTIC_TRAINER_RDZV_CONN"])
    password_file = Path(conn["password_file"])
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600 and password_file.read_text() == CANARY
    aws_file = Path(report["environ"]["AWS_SHARED_CREDENTIALS_FILE"])
    assert stat.S_IMODE(aws_file.stat().st_mode) == 0o600 and STORAGE_CANARY in aws_file.read_text()
    assert "AWS_SECRET_ACCESS_KEY" not in report["environ"]
    wandb_file = Path(report["environ"]["ELASTIC_TRAINER_WANDB_KEY_FILE"])
    assert stat.S_IMODE(wandb_file.stat().st_mode) == 0o600 and wandb_file.read_text() == WANDB_CANARY
    output = _finish(proc, out, tmp_path)
    from elastic_trainer import storage
    fs, root = storage.get_fs(s3_url)
    assert [p for p in fs.find(root) if p.endswith("manifest.json")], "the worker saved no checkpoint"
    assert CANARY not in output and STORAGE_CANARY not in output and not _files_holding(tmp_path / "logs", CANARY)
    assert not password_file.exists() and not aws_file.exists() and not wandb_file.exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_embedded_etcd_and_the_runs_files_are_private_to_its_user(tmp_path, procs):
    proc, out, report = _run_probe(tmp_path, procs, ["--run-id", "private"], {})
    assert report["fence_error"] is None
    logs = tmp_path / "logs"
    assert stat.S_IMODE((logs / "etcd").stat().st_mode) == 0o700
    assert stat.S_IMODE((logs / "etcd-password").stat().st_mode) == 0o600
    # --umask 077 by default: nothing the run created (checkpoints, logs, etcd's data) is open to others.
    created = [p for root in (tmp_path / "ck", logs) for p in [root, *root.rglob("*")]]
    assert any(p.name == "manifest.json" for p in created)
    assert not [f"{p} {stat.S_IMODE(p.stat().st_mode):o}" for p in created if p.stat().st_mode & 0o077]
    password = (logs / "etcd-password").read_text().strip()
    assert any(c.split()[0].endswith("etcd") for c in report["cmdlines"])  # the embedded etcd is looked at too
    assert password not in json.dumps(report["environ"]) and not [c for c in report["cmdlines"] if password in c]

    join = re.search(r"join from another terminal with: elastic-train (.*)$",
                     (tmp_path / "stderr").read_text(), re.M).group(1).split()
    endpoint = join[join.index("--rdzv-endpoint") + 1]
    state_key = "/elastic-trainer/private/state"
    # Without credentials etcd answers nothing, and takes no write.
    anonymous = _anonymous(endpoint)
    try:
        for attempt in (lambda: anonymous.get(state_key), lambda: anonymous.put(state_key, b"{}"),
                        lambda: anonymous.put("/elastic-trainer/private/alive/intruder_1_0", b"")):
            with pytest.raises(grpc.RpcError) as refused:
                attempt()
            assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
    finally:
        anonymous.close()
    # The printed join command works for this user: its start check and the rendezvous's own client.
    run = launch.parse_run_config([*join, "--checkpoint-dir", str(tmp_path / "ck2"), "--log-dir", str(tmp_path / "l2")])
    launch.check_environment(run)
    from elastic_trainer.etcd.client import EtcdConnection
    options = RendezvousOptions(RendezvousParameters("etcd-v3", endpoint, "private", 1, 1, **run.rdzv_conf))
    conn = EtcdConnection(options.etcd)
    try:
        assert conn.client.get(state_key)[0] is not None
    finally:
        conn.close()
    # ... and fails for another user of the machine, who cannot read the password file.
    if os.geteuid() == 0:
        other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cli_cmd(
            *join, "--checkpoint-dir", "/tmp", "--log-dir", "/tmp")], capture_output=True, text=True, timeout=60,
            cwd="/tmp", env={**os.environ, "PYTHONPATH": str(REPO)})
        assert other.returncode == 2 and "password_file=" in other.stderr and "Permission denied" in other.stderr, \
            other.stderr[-2000:]
    assert password not in _finish(proc, out, tmp_path)


# -- a canary in every documented input: no process the launcher starts, file, output holds one -------

URL_KEY, URL_SECRET = "AKIDCANARYURL29", "canaryUrl/Secret29"  # an AWS-style secret, with a "/" in it
ENV_KEY, ENV_SECRET, ENV_TOKEN = "AKIDCANARYENV29", "canaryEnvSecret29", "canaryEnvSessionToken29"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_no_canary_reaches_a_process_the_launcher_starts_a_file_or_the_output(s3_url, tmp_path, procs):
    """Issue 29. The launcher's environment holds a canary in each documented input: the checkpoint
    URL's S3 keys, ``AWS_*`` (another key pair and a session token), ``WANDB_API_KEY`` and the etcd
    password variable; the embedded etcd's own password is one more. While the job runs (a worker
    with W&B open, the embedded etcd, W&B's service), no process below the launcher has one in its
    command line or environment, and etcd's environment has only ``env.HELPER_ENV``'s basics; after
    the run none is in the output, in a file under the log dir (etcd's data, W&B's files, the agents'
    logs) or in the checkpoint's objects. The launcher's own environment is the documented exception."""
    bucket_path = s3_url.split("://", 1)[1]
    given = [URL_KEY, URL_SECRET, ENV_KEY, ENV_SECRET, ENV_TOKEN, WANDB_CANARY, CANARY]
    proc, out, report = _run_probe(
        tmp_path, procs, ["--run-id", "canary29"],
        {"ELASTIC_TRAINER_CHECKPOINT_DIR": f"s3://{URL_KEY}:{URL_SECRET}@{bucket_path}",
         "AWS_ACCESS_KEY_ID": ENV_KEY, "AWS_SECRET_ACCESS_KEY": ENV_SECRET, "AWS_SESSION_TOKEN": ENV_TOKEN,
         "WANDB_API_KEY": WANDB_CANARY, "WANDB_MODE": "offline", "PROBE_WANDB": "1",
         "ELASTIC_TRAINER_RDZV_PASSWORD": CANARY}, checkpoint_dir=False)
    assert report["fence_error"] is None
    logs = tmp_path / "logs"
    password = (logs / "etcd-password").read_text().strip()
    launcher_environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
    assert all(secret.encode() in launcher_environ for secret in given)  # the canaries were there to leak
    below = _processes_below(proc.pid, [*given, password])
    etcd = [env for cmd, env in below.values() if cmd.split(b"\0")[0].endswith(b"etcd")]
    assert len(etcd) == 1, [cmd[:60] for cmd, _ in below.values()]
    names = {entry.split(b"=", 1)[0].decode() for entry in etcd[0].split(b"\0") if entry}
    assert names and not {n for n in names if n not in HELPER_ENV and not n.startswith("LC_")}, names
    assert sum(b"secret_probe" in cmd for cmd, _ in below.values()) == 1
    output = _finish(proc, out, tmp_path)
    assert list((logs / "wandb").glob("offline-run-*")), "W&B wrote no offline run"
    assert list((logs / "etcd").rglob("*.wal")), "no etcd data under the log dir"
    from elastic_trainer import storage
    fs, root = storage.get_fs(s3_url)
    objects = fs.find(root)
    assert [p for p in objects if p.endswith("manifest.json")], "the worker saved no checkpoint"
    for secret in [*given, password]:
        assert secret not in output
        assert not [p for p in objects if secret in p or secret.encode() in fs.cat_file(p)]
        held = _files_holding(logs, secret)
        if secret == password:  # the embedded etcd's own password: its 0600 file, and etcd 3.4's log of
            # the `user add` that set it (3.5 hashes a password before its log: etcd-io/etcd#11943),
            # in the 0700 data dir beside that file
            held = [h for h in held if h != str(logs / "etcd-password") and not h.endswith(".wal")]
        assert not held, (secret, held)


@pytest.mark.parametrize("url", ["memory://KEY:{secret}@bucket/run", "file://user:{secret}@localhost/tmp/run",
                                 "gcs://{secret}@bucket/run", "az://account:{secret}@container/run",
                                 "s3://{secret}@bucket/run"])
def test_credentials_in_a_url_whose_keys_nothing_routes_are_refused_at_start_in_one_line(
        url, tmp_path, monkeypatch, capsys, nothing_connects):
    # From the launcher's environment, where a URL with keys belongs: only s3://KEY:SECRET@ has them
    # moved into a credentials file; any other userinfo would reach etcd's commit records and the
    # workers' environment as it is. Refused before anything starts (no log dir, no etcd).
    monkeypatch.setenv("ELASTIC_TRAINER_CHECKPOINT_DIR", url.format(secret=STORAGE_CANARY))
    assert cli.main(["--log-dir", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("elastic-train: error: --checkpoint-dir: "), err
    assert "***@" in err and STORAGE_CANARY not in err
    assert ("keys in an S3 URL go right after s3://" if url.startswith("s3") else "credentials in the URL are refused") in err
    assert not (tmp_path / "logs").exists()


def test_the_commit_record_in_etcd_names_the_url_without_its_keys():
    # A trainer started by torchrun itself gets the URL as given, keys and all: the record (which
    # every node with the run's etcd credentials reads) keeps the URL without them, under one key.
    from elastic_trainer.checkpoint.record import CommitRecord, record_key

    class Fence:
        prefix = "/elastic-trainer/r/"

    record = CommitRecord(Fence(), f"s3://{URL_KEY}:{URL_SECRET}@bucket/run")
    assert record.url == "s3://bucket/run" and record.key == record_key(Fence.prefix, "s3://bucket/run")


def test_aws_keys_leave_the_workers_environment_whatever_the_checkpoint_urls_protocol(tmp_path, monkeypatch):
    from elastic_trainer.rendezvous import options

    monkeypatch.setattr(options, "_launcher_password", None)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ENV_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    monkeypatch.setenv("ELASTIC_TRAINER_RDZV_PASSWORD", CANARY)
    with secrets.handed_over(str(tmp_path / "ck")) as url:
        assert url == str(tmp_path / "ck")
        assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "ELASTIC_TRAINER_RDZV_PASSWORD"} & set(os.environ)
        credentials = Path(os.environ["AWS_SHARED_CREDENTIALS_FILE"])
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600 and ENV_SECRET in credentials.read_text()
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == ENV_SECRET and not credentials.exists()
    assert options.launcher_password() == CANARY  # kept for the rendezvous handler, in this process only


# -- redaction: a canary secret in the etcd password and the storage URL shows up nowhere ---------------

def test_storage_url_credentials_are_used_and_redacted(s3_url):
    from elastic_trainer import storage

    bucket_path = s3_url.split("://", 1)[1]
    url = f"s3://testing:{STORAGE_CANARY}@{bucket_path}"
    fs, path = storage.get_fs(url)
    assert path == bucket_path and fs.secret == STORAGE_CANARY
    storage.check_writable(url)
    assert storage.redact(f"saved to {url}") == f"saved to s3://***@{bucket_path}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_canary_secret_shows_up_in_no_output_log_wandb_file_or_checkpoint(auth_etcd, s3_url, tmp_path, run_id):
    """A job with the canary as etcd password (launcher env var) and as S3 secret (in the storage URL),
    W&B on (offline), run twice (the second resumes): stdout, stderr, every file under the log dir
    (agent logs, step and event logs, W&B offline files) and every checkpoint object hold neither."""
    from elastic_trainer import storage

    bucket_path = s3_url.split("://", 1)[1]
    url = f"s3://testing:{STORAGE_CANARY}@{bucket_path}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["ELASTIC_TRAINER_RDZV_PASSWORD"] = CANARY
    env["ELASTIC_TRAINER_CHECKPOINT_DIR"] = url  # a URL with keys comes from the launcher's environment
    env["WANDB_API_KEY"], env["WANDB_MODE"] = WANDB_CANARY, "offline"  # a key, and no network
    logs = tmp_path / "logs"
    outputs = []
    for steps in ("2", "4"):
        proc = subprocess.run(cli_cmd("--nnodes", "1", "--rdzv-endpoint", auth_etcd.endpoint, "--run-id", run_id,
                                      "--rdzv-conf", "user=root", "--log-dir", str(logs),
                                      "--", *TINY, "--global-batch-size", "8", "--no-progress",
                                      "--max-steps", steps, "--checkpoint-every", "2"),
                              capture_output=True, text=True, timeout=200, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs += [proc.stdout, proc.stderr]
    text = "\n".join(outputs)
    assert "resumed from step 2" in text or "step-2" in text, text[-3000:]  # the second run did resume
    assert f"s3://{bucket_path}" in text, [ln for ln in text.splitlines() if "s3://" in ln or "step-" in ln][:8]
    assert list((logs / "wandb").glob("offline-run-*")), "W&B wrote no offline run"
    fs, root = storage.get_fs(url)
    objects = [p for p in fs.find(root)]
    assert any(p.endswith("manifest.json") for p in objects)
    for secret in (CANARY, STORAGE_CANARY, WANDB_CANARY):
        assert secret not in text
        assert not _files_holding(logs, secret)
        assert not [p for p in objects if secret.encode() in fs.cat_file(p)]


def test_a_client_without_credentials_can_neither_read_nor_write_the_runs_keys(auth_etcd, tmp_path, run_id):
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from elastic_trainer.rendezvous import handler_creator

    secret = _secret_file(tmp_path / "pw")
    handler = handler_creator()(RendezvousParameters("etcd-v3", auth_etcd.endpoint, run_id, 1, 1,
                                                     local_addr="127.0.0.1", user="root", password_file=str(secret)))
    try:
        assert handler.next_rendezvous().world_size == 1
        prefix = f"/elastic-trainer/{run_id}/"
        anonymous = _anonymous(auth_etcd.endpoint)
        try:
            for attempt in (lambda: anonymous.get(prefix + "state"), lambda: list(anonymous.get_prefix(prefix)),
                            lambda: anonymous.put(prefix + "state", b"{}"), lambda: anonymous.delete_prefix(prefix),
                            lambda: anonymous.put(prefix + "alive/intruder_1_0", b"")):
                with pytest.raises(grpc.RpcError):
                    attempt()
        finally:
            anonymous.close()
        wrong = _secret_file(tmp_path / "wrong", "not-the-password")
        with pytest.raises(RendezvousConnectionError, match="check the user and password"):
            handler_creator()(RendezvousParameters("etcd-v3", auth_etcd.endpoint, run_id, 1, 1, user="root",
                                                   password_file=str(wrong), connect_timeout="2"))
        assert handler.num_nodes_waiting() == 0  # the round stands, untouched
    finally:
        handler.shutdown()


@pytest.mark.timeout(120)
def test_wandb_takes_its_key_from_the_file_the_launcher_hands_over_and_writes_it_nowhere(tmp_path):
    """What a worker does with ``ELASTIC_TRAINER_WANDB_KEY_FILE``: the key reaches W&B in its settings,
    stays out of the process's environment, and out of W&B's (offline) files; an unreadable file is
    one sentence naming it; an absent one (an optional Secret not created) means offline."""
    key_file = tmp_path / "wandb-api-key"
    key_file.write_text(WANDB_CANARY)
    key_file.chmod(0o600)
    code = ("import os; from elastic_trainer.training import metrics; "
            "lg = metrics.init_wandb(enabled=True, run_id='keyfile1', log_dir=os.environ['LOGS'], project='p', config={}); "
            "print('KEY', lg.run.settings.api_key == os.environ.get('EXPECT'), 'WANDB_API_KEY' in os.environ); lg.finish()")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", ELASTIC_TRAINER_WANDB_KEY_FILE=str(key_file), LOGS=str(tmp_path / "logs"),
               EXPECT=WANDB_CANARY, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KEY True False" in proc.stdout
    assert list((tmp_path / "logs").rglob("*.wandb")) and not _files_holding(tmp_path / "logs", WANDB_CANARY)
    key_file.chmod(0o000)  # there, but not readable: an error, not a silent offline run
    if os.geteuid() != 0:  # (root reads it anyway)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=env)
        assert proc.returncode != 0 and f"cannot read the W&B API key file {key_file}" in proc.stderr
    # absent (an optional Kubernetes Secret nobody created): no key, offline, said once
    env.update(ELASTIC_TRAINER_WANDB_KEY_FILE=str(tmp_path / "missing"), EXPECT="")
    proc = subprocess.run([sys.executable, "-c", code.replace("lg.run.settings.api_key == os.environ.get('EXPECT')",
                                                              "not lg.run.settings.api_key")],
                          capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KEY True False" in proc.stdout and f"no W&B API key file at {tmp_path / 'missing'}" in proc.stderr


def test_wandb_run_config_and_the_trainers_prints_redact_storage_keys():
    # For a trainer started without elastic-train (torchrun, python -m elastic_trainer.train), which
    # gets the URL with its keys as it was given.
    from elastic_trainer.config import TrainConfig
    from elastic_trainer.training.reporting import wandb_config

    config = wandb_config(TrainConfig(checkpoint_dir=f"s3://AKIDEXAMPLE:{STORAGE_CANARY}@bucket/run"))
    assert config["checkpoint_dir"] == "s3://***@bucket/run" and STORAGE_CANARY not in json.dumps(config)


def test_the_launchers_password_variable_is_gone_after_the_first_read_and_serves_every_handler(
        auth_etcd, run_id, monkeypatch):
    from elastic_trainer.rendezvous import handler_creator, options

    monkeypatch.setattr(options, "_launcher_password", None)
    monkeypatch.setenv("ELASTIC_TRAINER_RDZV_PASSWORD", CANARY)
    create = handler_creator()
    first = create(RendezvousParameters("etcd-v3", auth_etcd.endpoint, run_id, 1, 2, local_addr="127.0.0.1",
                                        user="root"))
    try:
        assert "ELASTIC_TRAINER_RDZV_PASSWORD" not in os.environ  # what workers inherit
        second = create(RendezvousParameters("etcd-v3", auth_etcd.endpoint, run_id, 1, 2, local_addr="127.0.0.1",
                                             user="root"))
        second.shutdown()
    finally:
        first.shutdown()
