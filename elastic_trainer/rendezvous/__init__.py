"""The ``etcd-v3`` rendezvous backend for torchrun (placeholder until the backend lands)."""


def handler_creator():
    """Entry point of the ``torchrun.handlers`` group: returns ``(RendezvousParameters) -> handler``."""
    def create(params):
        raise NotImplementedError("the etcd-v3 rendezvous backend is not built yet")
    return create
