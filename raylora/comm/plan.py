"""How far will a LoRA job scale, and does gradient compression help? ``raylora plan CONFIG --cards ...``.

The model, per optimizer step of one card (data parallel, every card holding the whole model):

    step(n) = compute + exposed(n)
    compute = measured: one local step of this job's model and LoRA on this machine, scaled by the ratio of the
              target card's matmul throughput to this machine's (``Link.tflops`` / measured), times the
              target's batch (tokens per card per step as configured)
    comm(n) = all-reduce time of the gradient bytes through the hook
    exposed(n) = max(0, comm(n) - overlap * backward), backward = 2/3 of compute (DDP overlaps the all-reduce of
              the last micro-step with its backward; with grad_accum > 1 only that micro-step's backward hides it)

All-reduce cost, for a payload of B bytes over n cards in nodes of ``per_node`` cards:
  ring (one node):       2 (n - 1) / n * B / bw_intra + 2 (n - 1) * latency_intra
  hierarchical (nodes):  intra-node reduce-scatter + inter-node ring all-reduce of B / per_node + intra-node
                         all-gather:  2 (p - 1) / p * B / bw_intra + 2 (m - 1) / m * (B / p) / bw_inter
                         + 2 (p - 1) * latency_intra + 2 (m - 1) * latency_inter,   p = per_node, m = n / p
  all-gather (topk):     (n - 1) * B_rank / bw (each card receives every other card's selection), no reduction
The gradient bytes are the trainable parameters of the real model with this job's LoRA config (counted from the
model built on the meta device, never hand-entered), times 4 (fp32 gradients) and each hook's measured
compression ratio on this job (``fp16``/``bf16`` 0.5; ``topk`` 2 * fraction for values + int32 indices;
``powersgd`` from its factor sizes). Assumptions: bandwidths are the link's sustained bus bandwidth; no
congestion between nodes; compute scales linearly with matmul throughput; compression's own compute is ignored.
"""
