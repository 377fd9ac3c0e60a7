"""What the tests share that is not a fixture (fixtures live in ``tests/conftest.py``).

- ``common``: helpers the test modules call: ``REPO``, ``cli_cmd``, ``wait_until`` (polling, raises
  on a timeout) and ``holds_within`` (fine polling, a bool to assert), ``DIST_ENV`` (what conftest's
  ``single_process_env`` clears), ``assert_same_state`` (exact state equality), ``mounted_tmpfs`` (a
  tiny filesystem, or a skip), ``etcd_conn`` (a client of a test's etcd), ``Processes`` (what a test
  starts, killed by process group: conftest's ``procs``).
- ``runs``: the tiny model's flags (``TINY``) and the trainer runs the end-to-end tests start and
  compare (``SEEDS_MSE``, ``baseline``, ``agent``, ``latest``, ``check_equivalence``, ...).
- ``ckpt_writer``: a checkpoint writer run as its own process (kills mid-save, concurrent writers).
- ``task_fixture``: a user task for the trainer, ``--task tests.helpers.task_fixture:build``.
- ``tls_certs``: a throw-away CA, server and client certificates (``cryptography``) for TLS etcd.
- ``k8s_pod``: a rendered pod's env and volumes resolved as the kubelet would (the k8s tests).
- ``wandb_records``: the records of a W&B offline run file (``preempting``, ``exit`` and its code).
- ``stream_data``: Parquet shards and token files whose rows say which sample they are (the stream tests).
- ``world_changes``: a hypothesis strategy for runs whose world size changes (the two sampler tests).

No test module imports another (``tests/test_layout.py`` checks it): what two of them share lives
here or in ``tests/conftest.py``. The rendezvous tests' torchrun worker is ``benchmarks/rdzv_worker.py``,
which the benchmarks measure with; tests import it from there, and nothing in benchmarks/ imports tests.
"""
