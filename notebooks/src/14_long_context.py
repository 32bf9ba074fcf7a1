# ---
# jupyter:
#   jupytext:
#     formats: ipynb,src//py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 14 · Long sequences: context parallelism
#
# **Time:** about 25 minutes ([the workshop day](../docs/workshop.md)).
#
# Data, tensor and pipeline parallelism all leave every rank holding whole sequences.
# At 128K tokens the activations of one sequence no longer fit a device, whatever the
# batch. **Context parallelism** splits every sequence over `cp` ranks: everything but
# attention works token by token and runs on a rank's own tokens as it is; attention
# needs every earlier token, so the ranks exchange keys and values. Two ways:
#
# - **Ring attention** (Liu et al. 2023): each rank keeps its queries; the key/value
#   blocks travel around the ring, each rank attending to the block it holds while the
#   next one is on its way, the partial results merged with an online softmax. With a
#   causal mask the tokens are dealt in a zigzag (rank r holds chunks r and 2cp-1-r of
#   2cp), so every rank has the same work.
# - **Ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses): an all-to-all turns the
#   sequence split into a split of the heads, ordinary attention runs on all tokens of
#   h/cp heads, and a second all-to-all turns it back.
#
# **Goal:** measure what context parallelism saves (activations per rank against
# sequence length), see the ring hide its transfers behind compute, count what ring and
# Ulysses send against their formulas, and train with both, equal to one process.

# %%
# %matplotlib inline
import nbpar
from matplotlib.figure import Figure
from nbpar.estimate import format_bytes

# %load_ext nbpar

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(4)
pool

# %% [markdown]
# ## Training with a split sequence
#
# `strategy="cp"` gives each of `cp` ranks its share of every sequence; on 4 engines
# `cp=2` leaves `dp=2` data-parallel replicas of a cp pair, `cp=4` one group of four.
# `attention` picks the ring or Ulysses. The positions stay global: rank 1's tokens of a
# zigzag split are not positions 0.., and the position embeddings must know it. Each
# run's loss is the mean over every token of the global batch, as one process computes it:

# %%
gpt = nbpar.GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64)
common = dict(model="tiny_gpt", gpt=gpt, micro_batch=2, steps=8, lr=3e-3, seed=0)
configs = {
    "single": nbpar.TrainConfig(strategy="single", grad_accum=4, **common),
    "ring cp 4": nbpar.TrainConfig(strategy="cp", cp=4, attention="ring", grad_accum=4, **common),
    "ulysses cp 4": nbpar.TrainConfig(strategy="cp", cp=4, attention="ulysses", grad_accum=4,
                                      **common),
    "ring cp 2 x dp 2": nbpar.TrainConfig(strategy="cp", cp=2, attention="ring", grad_accum=2,
                                          **common),
}
results = {name: pool.train(cfg).wait().result() for name, cfg in configs.items()}

# %% [markdown]
# (`single` runs micro-batches of 2 sequences 4 times a step; the cp 4 runs read the same
# 8 sequences a step; cp 2 x dp 2 reads them as 2 replicas x 2 micro-batches.)

# %%
reference = results["single"]["losses"]
for name, res in results.items():
    gap = max(abs(a - b) for a, b in zip(res["losses"], reference))
    print(f"{name:17s} losses {[round(x, 2) for x in res['losses'][::2]]}  "
          f"within 1e-5 of single: {gap < 1e-5}")
    assert gap < 1e-5

# %% [markdown]
# ## Activations per rank against sequence length
#
# What a rank saves for backward grows with the tokens it holds. The same model with
# micro-batches of 2 sequences per rank, at 3 sequence lengths, as data parallelism
# (`cp = 1`: every rank holds whole sequences) and split over 2 and 4 ranks; each run's
# `activation_bytes` is what autograd saved during its metered step, measured per rank.

# %%
lengths, degrees = (64, 128, 256), (1, 2, 4)
saved = {}
for cp in degrees:
    for s in lengths:
        cfg = nbpar.TrainConfig(model="tiny_gpt", micro_batch=2, steps=3, seed=0,
                                gpt=nbpar.GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=s),
                                **({"strategy": "ddp"} if cp == 1 else {"strategy": "cp", "cp": cp}))
        saved[cp, s] = pool.train(cfg).wait().result()["ranks"][0]["activation_bytes"]
for cp in degrees:
    print(f"cp {cp}: " + ", ".join(f"{s} tokens {format_bytes(saved[cp, s])}" for s in lengths))

# %%
ax = Figure(figsize=(6, 3.5), layout="constrained").add_subplot()
for cp in degrees:
    ax.plot(lengths, [saved[cp, s] / 2**20 for s in lengths], marker="o",
            label=f"cp = {cp}" + (" (data parallel)" if cp == 1 else ""))
ax.set_xscale("log", base=2)
ax.set_xticks(lengths, [str(s) for s in lengths])
ax.set_xlabel("sequence length (tokens)")
ax.set_ylabel("activations per rank (MiB)")
ax.set_title("what a rank saves for backward, measured", fontsize="medium")
ax.legend(fontsize="small")
ax.figure

# %%
shares = {(cp, s): saved[cp, s] / saved[1, s] for cp in degrees[1:] for s in lengths}
for (cp, s), share in shares.items():
    print(f"cp {cp} at {s} tokens holds {share:.2f} of data parallelism's activations")
assert all(abs(share - 1 / cp) < 0.05 for (cp, s), share in shares.items())
assert all(saved[1, b] > 1.9 * saved[1, a] for a, b in zip(lengths, lengths[1:]))

# %% [markdown]
# Each rank holds `1/cp` of the activations at every length: the split sequence is the
# only thing that shrinks them without shrinking the batch. No attention here keeps its
# `s x s` scores for backward (one process's `scaled_dot_product_attention` and the ring
# both recompute them), so the activations grow with `s`, not `s²`, as with the
# flash-attention kernels used on GPUs.

# %% [markdown]
# ## The ring, step by step
#
# `nbpar.parallel.ring_trace.RingTrace` records what each rank's ring attention did when:
# the block it computed, and the next block travelling meanwhile. One attention over
# 2,048 tokens (4 heads of 32) on 4 ranks, forward and backward:

# %%
# %%dist
import torch
import torch.distributed as dist
from nbpar.parallel.context import local_positions, ring_attention
from nbpar.parallel.ring_trace import RingTrace

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, 2048, 32, generator=g) for _ in range(3))
mine = local_positions("ring", 2048, dist.get_world_size(), dist.get_rank())
q, k, v = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
ring_attention(q, k, v).sum().backward()  # once untraced: warm
with RingTrace() as trace:
    ring_attention(q, k, v).sum().backward()
print(f"{len(trace.spans)} spans")


# %%
def traced():
    return trace.spans  # runs on an engine, in its namespace


spans = pool.run(traced)
fig = Figure(figsize=(10, 3.6), layout="constrained")
ax = fig.subplots()
colours = {"compute": "tab:blue", "transfer": "tab:orange"}
for rank, rows in enumerate(spans):
    for s in rows:
        y = rank + (0.18 if s["kind"] == "transfer" else -0.12)
        height = 0.16 if s["kind"] == "transfer" else 0.3
        ax.barh(y, (s["end"] - s["start"]) * 1e3, left=s["start"] * 1e3, height=height,
                color=colours[s["kind"]], alpha=0.9 if s["pass"] == "forward" else 0.5,
                edgecolor="black", linewidth=0.4)
ax.set_yticks(range(len(spans)), [f"rank {r}" for r in range(len(spans))])
ax.invert_yaxis()
ax.set_xlabel("ms since the rank's forward began (forward dark, backward light)")
ax.legend(handles=[ax.barh(0, 0, color=c, label=k) for k, c in colours.items()],
          fontsize="small", loc="lower right")
ax.set_title("ring attention on 4 ranks: block i computed while block i+1 travels",
             fontsize="medium")
fig

# %%
forward = [[s for s in rows if s["pass"] == "forward"] for rows in spans]
for rows in forward:
    computes = [s for s in rows if s["kind"] == "compute"]
    for t in (s for s in rows if s["kind"] == "transfer"):
        assert t["start"] <= computes[t["step"]]["start"]  # posted before the compute
print("every forward transfer was posted before the block computed beside it: True")

# %% [markdown]
# In the forward each rank posts the send of the block it holds and the receive of the
# next, then computes: the orange bar spans from posting to the rank seeing the block
# arrive, the blue box beneath it the compute it travelled behind. Where an orange bar
# ends well after its blue box, the rank waited: on a laptop the "network" is a memory
# copy between processes, but the four ranks share a few cores, so a block often arrives
# only when its sender got the core to post it, and the bar measures that wait more than
# the wire. The backward
# (light) computes first and then passes the block on with its gradients: it hides
# nothing here, which is why the ring's backward is its exposed part.

# %% [markdown]
# ## What ring and Ulysses send, against their formulas
#
# Per layer and micro-batch, with `B` bytes of one rank's share of k (or v), and `Q` of
# its share of q:
#
# - the ring sends `cp - 1` K/V block pairs in the forward, the same again in the
#   backward, and `cp` pairs of their gradients (the last hop brings them home):
#   `2 B x (2(cp-1) + cp)`;
# - Ulysses makes four all-to-alls in the forward (q, k, v, output) and four in the
#   backward, each moving `(cp-1)/cp` of its tensor: `2 x (2Q + 2B) x (cp-1)/cp`.
#
# (The gradients' all-reduce comes on top, as in data parallelism.) Measured by the c10d
# meter on the cp 4 runs above:

# %%
cp, L, G, b = 4, gpt.n_layers, 4, 2
tokens, width = gpt.seq_len // cp, gpt.d_model  # a rank's share; heads x head dim = d
B = b * tokens * width * 4  # fp32
theory = {"ring": G * L * 2 * B * (2 * (cp - 1) + cp),
          "ulysses": G * L * 2 * (2 * B + 2 * B) * (cp - 1) / cp}
measured = {"ring": results["ring cp 4"]["ranks"][0]["comm_bytes_by_op"]["send_recv"],
            "ulysses": results["ulysses cp 4"]["ranks"][0]["comm_bytes_by_op"]["all_to_all"]}
for kind in ("ring", "ulysses"):
    print(f"{kind:8s} measured {format_bytes(measured[kind])}, formula "
          f"{format_bytes(theory[kind])} per rank and step")
    assert abs(measured[kind] / theory[kind] - 1) < 0.1
print(f"the ring sends {measured['ring'] / measured['ulysses']:.1f}x what Ulysses sends here")

# %% [markdown]
# At equal cp the ring sends more (every rank sees every K/V block, `(cp-1)` times in
# each direction), but in point-to-point messages to a neighbour, overlapped with
# compute; Ulysses sends less, in all-to-alls that every rank joins and nothing hides,
# and it cannot split over more ranks than there are heads (key/value heads for
# grouped-query attention, or it repeats them). Llama 3 trained its 128K-token stage with
# a ring of 16 (Dubey et al. 2024); DeepSpeed-Ulysses targets the heads' count.

# %%
pool.shutdown()

# %% [markdown]
# ## At full size, on fake ranks: Llama 3 8B at 128K tokens on cp 8
#
# Which split when, in numbers: `nbpar.simulate` runs one rank of an 8-rank job on fake
# tensors (shapes, no data) with the same strategy code as the runs above, here Llama 3
# 8B's shape (transformers' Llama with random weights, nothing downloaded), one
# sequence of 131,072 tokens, bf16, ring attention over cp 8, FSDP2 over the 8 ranks
# and full activation checkpointing. A sequence this long does not fit one device
# however the model is sharded; split 8 ways, each rank keeps 16K tokens' activations.

# %%
LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  max_position_embeddings=131072)
long = nbpar.TrainConfig(model="hf:llama", model_config=LLAMA_3_8B, strategy="hybrid",
                         dp=1, cp=8, attention="ring", fsdp_reshard=True, precision="bf16",
                         micro_batch=1, gpt=nbpar.GPTConfig(seq_len=131072),
                         activation_checkpointing="full")
sim = nbpar.simulate(long, world_size=8, device_memory_gb=80)
(rank,) = sim["ranks"]
print(f"one rank of 8: states {format_bytes(rank['param_bytes'] + rank['grad_bytes'] + rank['optim_bytes'])}, "
      f"activations {format_bytes(rank['activation_bytes'])}, peak {format_bytes(rank['peak_bytes'])}; "
      f"fits 80 GB: {sim['fits']}")
print(f"the ring passes {format_bytes(rank['comm_bytes_by_op']['send_recv'])} of K/V blocks "
      f"a step per rank")
assert sim["fits"] and rank["stands_for"] == list(range(8))

# %% [markdown]
# The figures are what the strategy code holds and sends on fake tensors (the peak
# includes FSDP2's gathered layers and the rebuilt block's activations, which no formula
# lists); the ring's bytes follow `nbpar.comm_estimate.context_bytes_per_step`, the
# forward's blocks sent three times a step with checkpointing (forward, recomputed
# forward, backward) and their gradients once. Ulysses at cp 8 would split 8 key/value
# heads one each; at cp 16, as Llama 3 trained its longest stage, it could not, the
# ring can.

# %% [markdown]
# **Takeaway.**
#
# - Context parallelism splits every sequence over `cp` ranks: each holds `1/cp` of the
#   activations at every length (measured), the one split that shrinks them without
#   shrinking the batch; the losses equal one process's.
# - Ring attention passes K/V blocks around, hiding each transfer behind the compute of
#   the block before; Ulysses trades the sequence split for a head split with
#   all-to-alls. Both send what their formulas say.
# - Positions must stay global: a split sequence is still one sequence.
