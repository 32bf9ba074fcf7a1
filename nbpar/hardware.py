"""Real hardware as data: devices (peak bf16 FLOP/s, memory), links (bandwidth, latency)
and machines built from them (GPUs per node, nodes, the links between them), with the two
sums they answer directly: how long a collective takes on a machine's links (the
alpha-beta model, `Hardware.call_seconds`) and how many days FLOPs take on its GPUs
(`days_to_train`). For `nbpar.project`'s estimates; pure Python, nothing measured here.

Sources. Peaks: dense (no sparsity) bf16 Tensor Core FLOP/s from NVIDIA's datasheets.
Bandwidths: the vendors' figures, always stored **per direction** (bytes a GPU can send
while it receives as much): NVLink's datasheet numbers are bidirectional totals (A100:
600 GB/s = 300 each way; H100/H200: 900 GB/s = 450 each way), PCIe's too (x16 gen 4:
64 GB/s = 32 each way), while network speeds (InfiniBand, Ethernet) are quoted per
direction already (400 Gb/s = 50 GB/s each way). Latencies: the order of magnitude of
one step of a ring (one hop, small message) as NCCL-tests show it on such links, a few
µs on NVLink and InfiniBand; typical figures, not measurements of a machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

from nbpar.checks import choice, positive_int
from nbpar.errors import ConfigError


@dataclass(frozen=True)
class Device:
    """One GPU model."""

    name: str
    bf16_tflops: float
    """dense bf16 peak, TFLOP/s (datasheet)"""
    memory_gb: float
    """device memory, decimal GB"""
    match: str
    """the part of torch's device name that identifies it (`nbpar.device.peak_flops_hint`)"""


@dataclass(frozen=True)
class Link:
    """A link a GPU sends over, per GPU and per direction."""

    name: str
    gbytes_per_s: float
    """bandwidth per direction, GB/s (1e9 bytes)"""
    latency_us: float
    """one ring step's latency, µs (typical, NCCL-tests order of magnitude)"""


# Most specific match first: "H100 PCIe" before "H100" (torch names "NVIDIA H100 PCIe").
DEVICES = {
    d.name: d
    for d in (
        Device("H200", 989.0, 141.0, "H200"),
        Device("H100-PCIe", 756.0, 80.0, "H100 PCIe"),
        Device("H100-NVL", 835.0, 94.0, "H100 NVL"),
        Device("H100-SXM", 989.0, 80.0, "H100"),
        Device("A100-80GB", 312.0, 80.0, "A100"),
        Device("L40S", 362.0, 48.0, "L40S"),
        Device("A10G", 70.0, 24.0, "A10G"),
    )
}

#: (part of a device name, dense bf16 peak TFLOP/s), most specific first.
PEAK_BF16_TFLOPS = tuple((d.match, d.bf16_tflops) for d in DEVICES.values())

LINKS = {
    link.name: link
    for link in (
        Link("NVLink 3", 300.0, 3.0),  # A100 SXM: 12 links, 600 GB/s both ways together
        Link("NVLink 4", 450.0, 3.0),  # H100/H200 SXM: 18 links, 900 GB/s both ways
        Link("PCIe 4 x16", 32.0, 5.0),  # 64 GB/s both ways
        Link("PCIe 5 x16", 64.0, 5.0),  # 128 GB/s both ways
        Link("InfiniBand 100", 12.5, 5.0),  # EDR, 100 Gb/s each way
        Link("InfiniBand 200", 25.0, 5.0),  # HDR, 200 Gb/s each way
        Link("InfiniBand 400", 50.0, 5.0),  # NDR, 400 Gb/s each way
        Link("Ethernet 100", 12.5, 10.0),  # 100 GbE with RoCE
    )
}


def ring(op: str, n: int) -> tuple[int, float]:
    """(latency terms, share of the whole tensor one rank sends) of one call of ``op`` on
    ``n`` ranks: the ring accounting of `nbpar.measure.comm` (Thakur et al. 2005)."""
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if op == "send_recv":
        return 1, 1.0
    return n - 1, (n - 1) / n  # all-gather, reduce-scatter, broadcast and the rest


@dataclass(frozen=True)
class Hardware:
    """``nodes`` nodes of ``gpus_per_node`` GPUs: ``intra`` joins the GPUs of a node,
    ``nics_per_node`` network cards of kind ``nic`` join the nodes."""

    name: str
    device: Device
    gpus_per_node: int = 1
    nodes: int = 1
    intra: Link | None = None
    nic: Link | None = None
    nics_per_node: int = 0

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def inter_gbytes_per_s(self) -> float:
        """One GPU's share of its node's network, per direction: the NICs' bandwidth over
        the GPUs that share them (every GPU of a node sends across nodes at once)."""
        return self.nic.gbytes_per_s * self.nics_per_node / self.gpus_per_node

    def link_for(self, span: int) -> tuple[str, float, float]:
        """(what, bytes/s, latency s) for a group whose ranks lie within ``span``
        consecutive GPUs: the node's link when they fit in one node, else the network,
        the slowest link of a ring that crosses nodes and so its pace."""
        if span <= self.gpus_per_node:
            if self.intra is None:
                raise ValueError(f"{self.name} has one GPU per node: no link to use")
            return self.intra.name, self.intra.gbytes_per_s * 1e9, self.intra.latency_us * 1e-6
        share = self.inter_gbytes_per_s()
        what = f"{self.nic.name}, {self.nics_per_node} NICs per {self.gpus_per_node} GPUs"
        return what, share * 1e9, self.nic.latency_us * 1e-6

    def call_seconds(self, op: str, group: int, span: int, sent: float, calls: float = 1.0):
        """(link, latency s, transfer s) of ``calls`` calls of ``op`` on ``group`` ranks
        within ``span`` consecutive GPUs sending ``sent`` bytes per rank in all: the
        alpha-beta model, calls x ring steps x latency + bytes / bandwidth."""
        link, bandwidth, latency = self.link_for(span)
        return link, calls * ring(op, group)[0] * latency, sent / bandwidth

    def assumptions(self) -> list[str]:
        """The sentences `call_seconds` rests on, for this machine."""
        notes = [
            "Time of a call (alpha-beta): ring steps x latency + bytes sent / bandwidth; a "
            "ring all-reduce of S bytes on n ranks sends 2(n-1)/n S in 2(n-1) steps, "
            "all-gather, reduce-scatter and broadcast (n-1)/n S in n-1 steps, a "
            "point-to-point send 1 step.",
            "Bandwidths are datasheet peaks per direction (NCCL reaches some 70-90% of them "
            "on large messages) and latencies typical of NCCL-tests: these times are a "
            "lower bound.",
        ]
        if self.nodes > 1:
            notes.append(
                "A group within one node uses the node's link; a group across nodes goes at "
                "the pace of its slowest link, the network, each GPU getting its node's NIC "
                "bandwidth over the GPUs that share it (ranks fill nodes in order, tp "
                "fastest)."
            )
        return notes

    def describe(self) -> str:
        """One line: GPUs, node link, network and each GPU's share of it."""
        d = self.device
        text = f"{self.name}: {self.gpus} x {d.name} ({d.bf16_tflops:g} TFLOP/s bf16, "
        text += f"{d.memory_gb:g} GB)"
        if self.intra is not None:
            text += f", in a node {self.intra.name} {self.intra.gbytes_per_s:g} GB/s"
        if self.nodes > 1:
            text += (
                f", {self.nodes} nodes over {self.nics_per_node} x {self.nic.name} "
                f"per node: {self.inter_gbytes_per_s():g} GB/s per GPU"
            )
        return text + (" (per direction)" if self.gpus > 1 else "")


def cluster(
    device: str,
    nodes: int = 1,
    *,
    gpus_per_node: int = 8,
    intra="NVLink 4",
    nic="InfiniBand 400",
    nics_per_node: int | None = None,
    name=None,
) -> Hardware:
    """A machine of ``nodes`` x ``gpus_per_node`` ``device`` GPUs; ``nics_per_node``
    defaults to one NIC per GPU (DGX A100 / H100: eight 200 / 400 Gb/s cards)."""
    choice("device", device, tuple(DEVICES))
    nodes = positive_int("nodes", nodes)
    gpus_per_node = positive_int("gpus_per_node", gpus_per_node)
    choice("intra", intra, tuple(LINKS))
    choice("nic", nic, tuple(LINKS))
    nics = gpus_per_node if nics_per_node is None else positive_int("nics_per_node", nics_per_node)
    return Hardware(
        name=name or f"{nodes}x{gpus_per_node}x{device}",
        device=DEVICES[device],
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        intra=LINKS[intra] if gpus_per_node > 1 else None,
        nic=LINKS[nic] if nodes > 1 else None,
        nics_per_node=nics if nodes > 1 else 0,
    )


def _presets() -> dict[str, Hardware]:
    one = [cluster(d, gpus_per_node=1, name=d) for d in ("A100-80GB", "H100-SXM", "H200")]
    nodes = [
        cluster("A100-80GB", intra="NVLink 3", name="8xA100-80GB"),
        cluster("H100-SXM", name="8xH100-SXM"),
        cluster("H200", name="8xH200"),
        cluster("A100-80GB", intra="PCIe 4 x16", name="8xA100-80GB-PCIe"),
        cluster("H100-PCIe", intra="PCIe 5 x16", name="8xH100-PCIe"),
    ]
    family = []
    for n in range(2, 9):  # one NIC per GPU (DGX), or one 100 GbE card per node
        family += [
            cluster(
                "A100-80GB", n, intra="NVLink 3", nic="InfiniBand 200", name=f"{n}x8xA100-200G"
            ),
            cluster("H100-SXM", n, name=f"{n}x8xH100-400G"),
            cluster("H200", n, name=f"{n}x8xH200-400G"),
            cluster("H100-SXM", n, nic="Ethernet 100", nics_per_node=1, name=f"{n}x8xH100-100GbE"),
        ]
    return {hw.name: hw for hw in one + nodes + family}


#: The named machines `nbpar.project` and ``nbpar project --hardware`` know.
PRESETS = _presets()


def positive_number(name: str, value, *, upper=None, optional=False) -> float | None:
    """``value`` as a float > 0 (and <= ``upper``); None passes when ``optional``;
    else ConfigError naming ``name``."""
    if value is None and optional:
        return None
    bad = isinstance(value, bool) or not isinstance(value, Real) or not value > 0
    if bad or (upper is not None and value > upper):
        allowed = f"a number in (0, {upper:g}]" if upper else "a positive number"
        raise ConfigError(f"{name} must be {allowed}, got {value!r}", fields=(name,))
    return float(value)


def lookup(name_or_hardware) -> Hardware:
    """The preset called ``name_or_hardware`` (a Hardware passes through); ConfigError
    naming ``hardware`` and the presets otherwise."""
    if isinstance(name_or_hardware, Hardware):
        return name_or_hardware
    choice("hardware", name_or_hardware, tuple(PRESETS))
    return PRESETS[name_or_hardware]


def days_to_train(
    params: float,
    tokens: float,
    hardware="A100-80GB",
    gpus: int | None = None,
    utilisation: float = 0.4,
) -> float:
    """Days of compute to train ``params`` parameters on ``tokens`` tokens: 6 x params x
    tokens FLOPs over ``gpus`` GPUs (default the machine's) at ``utilisation`` of their
    bf16 peak; no communication, perfect scaling. ``hardware``: a preset, a
    `Hardware` or a device of `nbpar.hardware.DEVICES`.

    The classic claim, "a 1B model: ~28 days on one A100, under 12 hours on 64", with 20
    tokens a parameter (Chinchilla, 20B tokens) at 0.4: 6e9 x 20e9 / (312e12 x 0.4) =
    961,538 s = 11.1 days on one A100, 4.2 hours on 64.
    """
    utilisation = positive_number("utilisation", utilisation, upper=1.0)
    params = positive_number("params", params)
    tokens = positive_number("tokens", tokens)
    if isinstance(hardware, str):
        choice("hardware", hardware, tuple(DEVICES) + tuple(PRESETS))
    if isinstance(hardware, str) and hardware in DEVICES:
        device, default = DEVICES[hardware], 1
    else:
        device, default = lookup(hardware).device, lookup(hardware).gpus
    gpus = positive_int("gpus", default if gpus is None else gpus)
    return training_seconds(params, tokens, gpus, device.bf16_tflops * 1e12, utilisation) / 86400


def training_seconds(params, tokens, gpus, peak_flops, utilisation) -> float:
    """6 N D FLOPs (2 in forward, 4 in backward a parameter and token) on ``gpus`` of
    ``peak_flops`` each at ``utilisation`` of it: perfect scaling, no communication."""
    return 6 * params * tokens / (gpus * peak_flops * utilisation)
