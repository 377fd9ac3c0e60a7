"""etcd, as every layer of elastic-trainer uses it: the client, the server we start, and its certificates.

- ``client``: ``EtcdConnection`` (connect fast, retry what is transient, fail over between the
  members of a cluster), ``EtcdOptions`` and how a launcher exports them to its workers without a
  password in the environment (``export_options`` / ``options_from_export``).
- ``access``: the password file's rules and what counts as loopback, without torch or gRPC (the
  keeper and ``elastic-train etcd`` need no client).
- ``store``: ``EtcdStore``, a torch ``Store`` kept in etcd (process groups built on it need no
  process to host their store).
- ``server``: ``EtcdServer``, the embedded etcd a run starts when no ``--rdzv-endpoint`` is given,
  and the helpers of ``elastic-train etcd``.
- ``member``: one member of an etcd cluster in a Kubernetes StatefulSet (``k8s/``).
- ``tls``: certificates for a standalone etcd (``elastic-train etcd certs``).

This package sits below ``rendezvous/``, ``live/``, ``checkpoint/`` and ``training/``: it imports
none of them. Each module is imported by name (``from elastic_trainer.etcd.client import ...``);
this file imports nothing, so that importing one does not import the others.
"""
