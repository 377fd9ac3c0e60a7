"""Which device a worker trains on, with which backend and precision, and how its steps are timed.

Every decision is a small function of what it is given (the flag, the local rank, what torch and
the node show), so that the CUDA paths are tested on machines without a GPU; ``CudaView.probe()``
is the one place that asks torch and the node. The rule: never train on the CPU by accident.

    view = devices.CudaView.probe()
    device = devices.pick_device("auto", local_rank, view)  # raises DeviceError, one sentence
    devices.backend_for(device)                            # "nccl" or "gloo"
    plan = devices.amp_plan("bf16", device, bf16_supported=True)
    timer = devices.step_timer(device); timer.start(); ...; took = timer.stop()  # took.seconds()
    batch = devices.to_device(batch, device)                # a micro-batch's tensors, nested or not

- ``--device auto`` trains on ``cuda:<local rank>`` when torch sees CUDA and on the CPU otherwise,
  *except* on a node that shows NVIDIA GPUs (``/dev/nvidia0``, GPUs in the driver's
  ``/proc/driver/nvidia/gpus``, or a ``CUDA_VISIBLE_DEVICES`` naming devices) that torch cannot use: the driver and
  the torch build do not match (or torch is a CPU-only build). That is an error; ``--device cpu``
  is the documented way to train on the CPU there on purpose.
- A local rank without a GPU of its own (``local_rank >= device_count``) is an error, never two
  ranks on one GPU (NCCL refuses two ranks of a communicator on one device, or hangs).
- ``--amp bf16`` is autocast to bfloat16 without a GradScaler (the exponent range of fp32);
  ``--amp fp16`` is float16 autocast with ``torch.amp.GradScaler`` and CUDA only; on the CPU,
  ``bf16`` is CPU autocast. A step the scaler skipped (inf/nan gradients: it lowers its scale) does
  not step the learning-rate scheduler (``scaler_skipped_step``).
- Step times on CUDA come from CUDA events on the step's stream, read at the next
  synchronisation point (the step-end agreement), so they measure the GPU's work, not how long
  the kernels took to queue; on the CPU they are ``time.perf_counter()`` around the step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from elastic_trainer.env import ENV_CUDA_VISIBLE_DEVICES

AMP_CHOICES = ("off", "bf16", "fp16")
DOCS = "docs/gpu.md"


class DeviceError(ValueError):
    """A device, backend or precision that cannot work here; the message is one sentence with the fix."""


# ------------------------------------------------------------------------------- what the node shows

def nvidia_hint(dev: Path = Path("/dev"), environ: Mapping[str, str] | None = None,
                driver: Path = Path("/proc/driver/nvidia/gpus")) -> str | None:
    """Evidence that this node has NVIDIA GPUs meant for this process, as a phrase, or None.

    What counts: a GPU's device file (``/dev/nvidia0``, what the NVIDIA container runtime mounts
    into a GPU pod), the driver's list of GPUs, or ``CUDA_VISIBLE_DEVICES`` naming devices (someone
    chose GPUs for this process). What does not: ``NVIDIA_VISIBLE_DEVICES`` and an installed
    ``nvidia-smi``, which the CUDA base images carry also when they run on a CPU node.
    ``CUDA_VISIBLE_DEVICES`` set to "" or "-1" hides every GPU on purpose: no evidence."""
    environ = os.environ if environ is None else environ
    visible = environ.get(ENV_CUDA_VISIBLE_DEVICES)
    if visible is not None and visible.strip() in ("", "-1"):
        return None
    if (dev / "nvidia0").exists():
        return f"{dev / 'nvidia0'} exists"
    if visible:
        return f"CUDA_VISIBLE_DEVICES={visible} is set"
    try:
        if driver.is_dir() and any(driver.iterdir()):
            return f"the NVIDIA driver lists GPUs in {driver}"
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class CudaView:
    """What this process sees of CUDA: torch's answer and the node's evidence of NVIDIA GPUs."""

    available: bool
    device_count: int
    torch_version: str
    cuda_build: str | None
    """The CUDA version torch was built for (``torch.version.cuda``); None for a CPU-only build."""
    hint: str | None = None
    """``nvidia_hint()``: evidence of NVIDIA GPUs on the node, whatever torch says."""

    @classmethod
    def probe(cls) -> "CudaView":
        available = torch.cuda.is_available()
        return cls(available=available, device_count=torch.cuda.device_count() if available else 0,
                   torch_version=torch.__version__, cuda_build=torch.version.cuda, hint=nvidia_hint())

    def why_unusable(self) -> str:
        """Why torch cannot use the GPUs this node shows, as far as this process can tell."""
        if self.cuda_build is None:
            return f"torch {self.torch_version} is a CPU-only build"
        return (f"torch {self.torch_version} is built for CUDA {self.cuda_build} and finds no usable device: "
                "the NVIDIA driver is older than that build needs, or not loaded in this container")


# ------------------------------------------------------------------------------------ the decisions

def pick_device(requested: str, local_rank: int, view: CudaView) -> torch.device:
    """The device of the worker with ``local_rank`` for ``--device requested`` (auto, cpu, cuda)."""
    if requested == "cpu":
        return torch.device("cpu")
    if requested not in ("auto", "cuda"):
        raise DeviceError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if not view.available:
        if requested == "cuda":
            raise DeviceError(f"--device cuda was asked for but torch sees no CUDA device ({view.why_unusable()}); "
                              f"install the torch build for this node's driver ({DOCS}) or use --device cpu")
        if view.hint is not None:
            raise DeviceError(f"--device auto: this node has NVIDIA GPUs ({view.hint}) but {view.why_unusable()}; "
                              f"install the torch build for this driver ({DOCS}), or pass --device cpu to train "
                              "on the CPU on purpose")
        return torch.device("cpu")
    if local_rank >= view.device_count:
        raise DeviceError(f"local rank {local_rank} has no GPU of its own: torch sees {view.device_count} "
                          f"({ENV_CUDA_VISIBLE_DEVICES}={os.environ.get(ENV_CUDA_VISIBLE_DEVICES, 'unset')}); run at most "
                          f"{view.device_count} workers on this node (--nproc-per-node {view.device_count} or gpu), "
                          "never two ranks on one GPU")
    return torch.device("cuda", local_rank)


def check_local_ranks(nproc_per_node: int, device_count: int) -> None:
    """One GPU per worker: ``nproc_per_node`` workers need that many visible GPUs."""
    if nproc_per_node > device_count:
        visible = os.environ.get(ENV_CUDA_VISIBLE_DEVICES)
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise DeviceError(f"{nproc_per_node} workers on this node need {nproc_per_node} GPUs, one each, but torch "
                          f"sees {device_count}{shown}; use --nproc-per-node {max(1, device_count)} (or gpu), "
                          "never two ranks on one GPU")


def nproc_per_node(text: str, view: CudaView) -> int:
    """``--nproc-per-node``'s words: ``gpu`` (one per GPU, an error without one, as torchrun),
    ``auto`` (one per GPU, else 1), ``cpu`` (1)."""
    if text == "gpu":
        if not view.available or view.device_count < 1:
            raise DeviceError(f"--nproc-per-node gpu: torch sees no GPU ({view.why_unusable()}"
                              f"{'; the node shows ' + view.hint if view.hint else ''}); give a number or use "
                              "--nproc-per-node cpu")
        return view.device_count
    if text == "auto":
        return max(1, view.device_count if view.available else 0)
    if text == "cpu":
        return 1
    raise DeviceError(f"--nproc-per-node takes a number, auto, gpu or cpu, got {text!r}")


def backend_for(device: torch.device) -> str:
    """The process group backend for ``device``: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class AmpPlan:
    """Autocast and loss scaling for ``--amp`` on one device."""

    dtype: torch.dtype | None
    """Autocast's dtype; None: no autocast (``--amp off``)."""
    scaler: bool
    """Whether a ``torch.amp.GradScaler`` scales the loss (fp16 only)."""


def amp_plan(amp: str, device: torch.device, bf16_supported: bool = True) -> AmpPlan:
    """What ``--amp`` means on ``device``; ``bf16_supported``: the GPU computes in bf16 natively
    (``torch.cuda.is_bf16_supported(including_emulation=False)``: Ampere and newer)."""
    if amp == "off":
        return AmpPlan(None, False)
    if amp == "fp16":
        if device.type != "cuda":
            raise DeviceError("--amp fp16 needs CUDA (float16 autocast with a GradScaler); on the CPU use "
                              "--amp bf16 or --amp off")
        return AmpPlan(torch.float16, True)
    if amp == "bf16":
        if device.type == "cuda" and not bf16_supported:
            raise DeviceError("--amp bf16: this GPU has no native bfloat16 (it needs Ampere or newer); "
                              "use --amp fp16")
        return AmpPlan(torch.bfloat16, False)
    raise DeviceError(f"--amp must be {', '.join(AMP_CHOICES[:-1])} or {AMP_CHOICES[-1]}, got {amp!r}")


def scaler_skipped_step(scale_before: float, scale_after: float) -> bool:
    """Whether a GradScaler skipped the optimizer step: ``update()`` lowers the scale exactly when
    the step found inf/nan gradients (and skipped it), and keeps or raises it otherwise."""
    return scale_after < scale_before


def to_device(batch, device: torch.device):
    """``batch`` (a tensor, or lists, tuples and dicts of tensors) on ``device``; other values as they are."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def set_tf32(device: torch.device, enabled: bool) -> None:
    """TF32 for float32 matmuls and convolutions on CUDA (``--tf32``, on by default; Ampere and
    newer). The CPU's settings are left as they are."""
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


# ------------------------------------------------------------------------------------- the first line

def banner(device: str, backend: str, torch_version: str, cuda_build: str | None = None,
           nccl_version: str | None = None, gpu_name: str | None = None) -> str:
    """The first line of a run: device (and GPU), backend (and NCCL's version), torch (and CUDA)."""
    where = f"device {device}" + (f" ({gpu_name})" if gpu_name else "")
    how = f"backend {backend}" + (f" (NCCL {nccl_version})" if nccl_version else "")
    build = f"torch {torch_version}" + (f" (CUDA {cuda_build})" if cuda_build else "")
    return f"{where}, {how}, {build}"


def describe(device: torch.device, backend: str) -> str:
    """``banner`` for this process: asks torch for the GPU's name and NCCL's version on CUDA."""
    if device.type != "cuda":
        return banner(str(device), backend, torch.__version__)
    props = torch.cuda.get_device_properties(device)
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version()) if backend == "nccl" else None
    return banner(str(device), backend, torch.__version__, torch.version.cuda, nccl,
                  f"{props.name}, capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB")


# ------------------------------------------------------------------------------------------ step times

class StepTime:
    """A step's duration: ``ready()`` without waiting, ``seconds()`` once it is known (CUDA: waits
    for the step's end event, which a synchronisation point has passed already)."""

    def __init__(self, seconds: float | None = None, events: tuple | None = None) -> None:
        self._seconds, self._events = seconds, events

    def ready(self) -> bool:
        return self._seconds is not None or self._events[1].query()

    def seconds(self) -> float:
        if self._seconds is None:
            start, end = self._events
            end.synchronize()
            self._seconds = start.elapsed_time(end) / 1000.0
        return self._seconds


class HostTimer:
    """``time.perf_counter()`` around the step: right where the host does the work (the CPU)."""

    def start(self, at: float | None = None) -> None:
        """From now, or from ``at`` (an earlier ``perf_counter()``)."""
        self._t0 = time.perf_counter() if at is None else at

    def stop(self) -> StepTime:
        return StepTime(seconds=time.perf_counter() - self._t0)


class CudaTimer:
    """CUDA events recorded on the device's current stream at the step's start and end: their
    difference is how long the GPU took, wherever the host was meanwhile."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self, at: float | None = None) -> None:
        """From now on the device's stream (``at``, a host time, has no meaning there: ignored)."""
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record(torch.cuda.current_stream(self.device))

    def stop(self) -> StepTime:
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        return StepTime(events=(self._start, end))


def step_timer(device: torch.device) -> HostTimer | CudaTimer:
    """The step timer for ``device``: CUDA events on CUDA, the host clock elsewhere."""
    return CudaTimer(device) if device.type == "cuda" else HostTimer()
