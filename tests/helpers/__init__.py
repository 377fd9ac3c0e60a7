"""What the tests share that is not a fixture (fixtures live in ``tests/conftest.py``).

- ``common``: helpers the test modules call: ``REPO``, ``cli_cmd``, ``wait_until`` (polling),
  ``read_jsonl``, ``assert_same_state`` (exact state equality), ``mounted_tmpfs`` (a tiny
  filesystem, or a skip).
- ``rdzv_worker``: a torchrun worker (gloo allreduce steps) and the harness that drives it;
  also imported by ``benchmarks/recovery.py`` and ``benchmarks/live_recovery.py``.
- ``ckpt_writer``: a checkpoint writer run as its own process (kills mid-save, concurrent writers).
- ``task_fixture``: a user task for the trainer, ``--task tests.helpers.task_fixture:build``.
- ``tls_certs``: a throw-away CA, server and client certificates (``cryptography``) for TLS etcd.
- ``k8s_pod``: a rendered pod's env and volumes resolved as the kubelet would (the k8s tests).
- ``wandb_records``: the records of a W&B offline run file (``preempting``, ``exit`` and its code).
"""
