"""Llama-family forward pass (Llama, Qwen2) on a paged KV pool, in plain PyTorch.

:class:`LlamaModel` runs one step for a batch (:class:`~talaria.engine.batch.BatchInput`) that
mixes prefill chunks and decode steps: each sequence computes some tokens starting at the
number of tokens its KV cache already holds. Projections and the MLP run over all tokens of
all sequences at once; attention runs per sequence over its paged KV (decode steps are batched
together).

Its neighbours: the model's shape is a :class:`~talaria.engine.arch.ModelArch`
(:mod:`talaria.engine.arch`); its weights are views bound by
:func:`~talaria.engine.weight_layout.bind_weights` (:mod:`talaria.engine.weight_layout`);
a step's batch and its planned device tensors are in :mod:`talaria.engine.batch`; the tensor
ops in :mod:`talaria.engine.ops`; paged attention in :mod:`talaria.engine.attention` and the
native CPU kernel in :mod:`talaria.engine.kernels`.

Conventions follow Hugging Face transformers: RMSNorm computed in float32, rotary embeddings
in the "rotate_half" layout with float32 frequencies, SwiGLU MLP, grouped-query attention where
KV head ``j`` serves query heads ``j * g .. (j + 1) * g - 1``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from talaria.engine.arch import ModelArch, RopeKind
from talaria.engine.attention import PagedGroup, Scratch, attend_decode, attend_prefill, gather_kv
from talaria.engine.batch import BatchInput, DecodeAttn, Plan, SeqAttn, SeqInput
from talaria.engine.kernels import MAX_SMALL_M, DecodeKernel
from talaria.engine.ops import apply_rope, linear, rms_norm
from talaria.engine.weight_layout import Layer, check_weights, layer_views
from talaria.errors import BadRequest, ConfigError, ContextTooLong

if TYPE_CHECKING:
    from talaria.engine.kv_pool import PagedKV


class LlamaModel:
    """Forward pass of a Llama-family model whose weights are the given views.

    The model keeps references to ``weights`` (e.g. from
    :func:`~talaria.engine.weight_layout.bind_weights`) and never copies them: copying new
    values into the views changes what the next forward computes.
    It also keeps a bounded attention scratch (:class:`~talaria.engine.attention.Scratch`,
    at most two tensors of :data:`~talaria.engine.attention.SCRATCH_BYTES`) reused by every
    step, so a model is not safe to run from two threads at once.
    """

    def __init__(
        self,
        arch: ModelArch,
        weights: Mapping[str, torch.Tensor],
        decode_kernel: DecodeKernel | None = None,
    ) -> None:
        self.arch = arch
        self.embed = check_weights(arch, weights)
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        usable = decode_kernel is not None and self.device.type == "cpu"
        usable = usable and DecodeKernel.supports(
            arch.n_heads, arch.n_kv_heads, arch.head_dim, self.dtype
        )
        self.decode_kernel = decode_kernel if usable else None
        self.layers = tuple(layer_views(weights, arch, i) for i in range(arch.n_layers))
        self.norm = weights["model.norm.weight"]
        self.lm_head = self.embed if arch.tie_word_embeddings else weights["lm_head.weight"]
        # the kernel's small product, when it takes every projection of this model (checked
        # once here: the views never change, so _linear checks only the batch size)
        self._gemm = self.decode_kernel
        if self._gemm is not None and not all(
            self._gemm.gemm_supports(w) for w in self._projections()
        ):
            self._gemm = None
        inv_freq, self._rope_scale = arch.rope_inv_freq()
        self._inv_freq = inv_freq.to(self.device)
        self.scratch = Scratch()

    @torch.no_grad()
    def forward(self, batch: BatchInput, kv: PagedKV) -> torch.Tensor:
        """Compute one step; returns logits ``[rows, vocab]`` in the weights' dtype.

        Mutates ``kv``: the K/V of every computed token is written to its slot (block
        ``block_table[p // tokens_per_block]``, offset ``p % tokens_per_block``). Raises
        ``BadRequest`` (``ContextTooLong`` past the context) before anything is written.
        """
        plan = self._plan(batch, kv)
        x = F.embedding(plan.ids, self.embed)
        eps = self.arch.rms_norm_eps
        for i, layer in enumerate(self.layers):  # x is this step's own tensor: add in place
            x.add_(self._attention(i, layer, rms_norm(x, layer.in_norm, eps), kv, plan))
            x.add_(self._mlp(layer, rms_norm(x, layer.post_norm, eps)))
        if plan.logit_rows is not None:
            x = x.index_select(0, plan.logit_rows)
        return self._linear(rms_norm(x, self.norm, eps), self.lm_head, contiguous=True)

    __call__ = forward

    def _linear(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None = None,
        contiguous: bool = False,
    ) -> torch.Tensor:
        """:func:`linear`, except up to ``MAX_SMALL_M`` bf16 rows go through the native
        kernel's small-batch product where there is one (small-batch decode reads every
        weight once per step; the kernel reads them near memory bandwidth)."""
        if self._gemm is not None and x.shape[0] <= MAX_SMALL_M:
            return self._gemm.gemm_small(x, w, b)  # validates x and b itself
        return linear(x, w, b, contiguous)

    def _projections(self) -> Iterable[torch.Tensor]:
        """Every weight :meth:`_linear` may be given, fused views included."""
        for layer in self.layers:
            yield from (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down)
            yield from (w for w in (layer.qkv, layer.gate_up) if w is not None)
        yield self.lm_head

    def _mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``down(silu(gate(h)) * up(h))``, ``h`` ``[T, hidden]``."""
        if layer.gate_up is not None:
            gate, up = self._linear(h, layer.gate_up).chunk(2, dim=-1)
        else:
            gate, up = self._linear(h, layer.gate), self._linear(h, layer.up)
        return self._linear(F.silu(gate).mul_(up), layer.down)

    def _qkv(self, layer: Layer, h: torch.Tensor, plan: Plan) -> tuple[torch.Tensor, ...]:
        """Rotated q ``[T, n_heads, hd]`` and k ``[T, n_kv_heads, hd]`` and v
        ``[T, n_kv_heads, hd]`` for ``h`` ``[T, hidden]`` (views of at most two tensors).

        With fused weights q and k are rotated together, as one ``[T, heads + kv_heads, hd]``.
        """
        a, t = self.arch, h.shape[0]
        nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        if layer.qkv is not None and (layer.q_bias is None or layer.qkv_bias is not None):
            qkv = self._linear(h, layer.qkv, layer.qkv_bias, contiguous=True)
            qk = apply_rope(qkv[:, : (nh + nkv) * hd].view(t, nh + nkv, hd), plan.cos, plan.sin)
            return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)
        q = self._linear(h, layer.q, layer.q_bias, contiguous=True).view(t, nh, hd)
        k = self._linear(h, layer.k, layer.k_bias, contiguous=True).view(t, nkv, hd)
        v = self._linear(h, layer.v, layer.v_bias, contiguous=True).view(t, nkv, hd)
        return apply_rope(q, plan.cos, plan.sin), apply_rope(k, plan.cos, plan.sin), v

    def _attention(
        self, i: int, layer: Layer, h: torch.Tensor, kv: PagedKV, plan: Plan
    ) -> torch.Tensor:
        """Attention block of layer ``i``: project, rotate, write K/V, attend, project out."""
        q, k, v = self._qkv(layer, h, plan)
        k_cache, v_cache = kv.layer(i)
        if k.dtype != kv.dtype:
            k, v = k.to(kv.dtype), v.to(kv.dtype)
        k_cache.index_put_((plan.slot_block, plan.slot_offset), k)
        v_cache.index_put_((plan.slot_block, plan.slot_offset), v)
        k_rows, v_rows = kv.rows(i)
        shape = (kv.tokens_per_block, self.arch.n_kv_heads, self.arch.head_dim)
        rows = h.shape[0]
        if plan.whole is not None:  # one decode chunk of every row, in order
            out = self._decode(q, k_rows, v_rows, plan.whole, shape)
        else:
            out = q.new_empty(q.shape)
            for s in plan.multi:
                k_ctx, v_ctx = gather_kv(k_rows, v_rows, s.group, shape, self.scratch)
                out[s.row0 : s.row1] = attend_prefill(q[s.row0 : s.row1], k_ctx, v_ctx, s.mask)
            for d in plan.decode:
                out[d.rows] = self._decode(q[d.rows], k_rows, v_rows, d.group, shape)
        return self._linear(out.reshape(rows, -1), layer.o, layer.o_bias)

    def _decode(
        self,
        q: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
        g: PagedGroup,
        shape: tuple[int, int, int],
    ) -> torch.Tensor:
        """Decode attention of group ``g``: the native kernel reading the pool in place when
        there is one for this model and KV dtype, else gather + SDPA."""
        kernel = self.decode_kernel
        if kernel is not None and g.lengths is not None and k_rows.dtype == torch.bfloat16:
            scale = self.arch.head_dim**-0.5
            return kernel.attend(q, k_rows, v_rows, g.tables, g.lengths, shape[0], scale)
        k_ctx, v_ctx = gather_kv(k_rows, v_rows, g, shape, self.scratch)
        return attend_decode(q, k_ctx, v_ctx, g.mask)

    # ------------------------------------------------------------------------- planning

    def _plan(self, batch: BatchInput, kv: PagedKV) -> Plan:
        """Validate ``batch`` against the model and ``kv`` and build the step's tensors.

        Raises before anything is written; index lists are built in Python and each becomes
        one tensor on the model's device.
        """
        self._check_kv(kv)
        if not isinstance(batch, BatchInput) or not batch.seqs:
            raise BadRequest("a batch needs at least one sequence")
        tpb = kv.tokens_per_block
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        multi: list[SeqAttn] = []
        decode: list[tuple[int, tuple[int, ...], int]] = []  # (row, used blocks, ctx)
        for i, seq in enumerate(batch.seqs):
            used = self._check_seq(i, seq, kv)
            row, n = len(ids), len(seq.token_ids)
            ids.extend(seq.token_ids)
            positions.extend(range(seq.start, seq.end))
            slots.extend(used[p // tpb] * tpb + p % tpb for p in range(seq.start, seq.end))
            if n == 1:
                decode.append((row, used, seq.end))
            else:
                multi.append(self._seq_attn(row, seq, used))
            logit_rows.extend(range(row if seq.all_logits else row + n - 1, row + n))
        if len(set(slots)) != len(slots):
            raise BadRequest("two sequences of the batch write the same KV slot")
        dev = self.device
        slot = torch.tensor(slots, dtype=torch.long)
        cos, sin = self._rope_tables(batch, torch.tensor(positions, dtype=torch.long))
        return Plan(
            ids=torch.tensor(ids, dtype=torch.long).to(dev),
            slot_block=(slot // tpb).to(dev),
            slot_offset=(slot % tpb).to(dev),
            cos=cos,
            sin=sin,
            multi=tuple(multi),
            decode=self._decode_attn(decode, kv),
            logit_rows=None
            if len(logit_rows) == len(ids)
            else torch.tensor(logit_rows, dtype=torch.long).to(dev),
        )

    def _check_kv(self, kv: PagedKV) -> None:
        if kv.arch != self.arch:
            raise ConfigError("the KV view was made for a different model architecture")
        if kv.device != self.device:
            raise ConfigError(f"KV pool on {kv.device} but weights on {self.device}")

    def _check_seq(self, i: int, seq: SeqInput, kv: PagedKV) -> tuple[int, ...]:
        """Validate sequence ``i``; returns the block ids it uses (``ceil(end / tpb)``)."""
        if not isinstance(seq, SeqInput):
            raise BadRequest(f"seqs[{i}] must be a SeqInput, got {type(seq).__name__}")
        if not seq.token_ids:
            raise BadRequest(f"seqs[{i}].token_ids must not be empty")
        vocab = self.arch.vocab_size
        if not 0 <= min(seq.token_ids) <= max(seq.token_ids) < vocab:
            j, t = next((j, t) for j, t in enumerate(seq.token_ids) if not 0 <= t < vocab)
            raise BadRequest(
                f"seqs[{i}].token_ids[{j}] = {t} is outside the vocabulary 0..{vocab - 1}"
            )
        if seq.end > self.arch.max_context:
            raise ContextTooLong(
                f"seqs[{i}] reaches position {seq.end} but the model's context is "
                f"{self.arch.max_context} tokens"
            )
        tpb = kv.tokens_per_block
        n_blocks = -(-seq.end // tpb)
        if len(seq.block_table) < n_blocks:
            raise BadRequest(
                f"seqs[{i}].block_table has {len(seq.block_table)} blocks ({tpb} tokens each) "
                f"but {seq.end} tokens need {n_blocks}"
            )
        used = seq.block_table[:n_blocks]
        if not 0 <= min(used) <= max(used) < kv.num_blocks:
            bad = next(b for b in used if not 0 <= b < kv.num_blocks)
            raise BadRequest(
                f"seqs[{i}].block_table names block {bad}, outside 0..{kv.num_blocks - 1}"
            )
        if len(set(used)) != len(used):
            raise BadRequest(f"seqs[{i}].block_table lists a block twice")
        return used

    def _seq_attn(self, row: int, seq: SeqInput, used: tuple[int, ...]) -> SeqAttn:
        n, dev = len(seq.token_ids), self.device
        mask = None
        if seq.start:
            query_pos = torch.arange(seq.start, seq.end).unsqueeze(1)
            mask = (torch.arange(seq.end).unsqueeze(0) <= query_pos).to(dev)
        blocks = torch.tensor(used, dtype=torch.long).to(dev)
        return SeqAttn(row, row + n, PagedGroup(1, blocks, len(used), seq.end, None), mask)

    def _decode_attn(
        self, decode: list[tuple[int, tuple[int, ...], int]], kv: PagedKV
    ) -> tuple[DecodeAttn, ...]:
        """Decode sequences ``(row, used blocks, ctx)`` in chunks whose gathered K fits the
        scratch limit (at least one sequence a chunk)."""
        k_rows = kv.rows(0)[0]
        limit = self.scratch.limit // (k_rows.shape[1] * k_rows.element_size())  # blocks a chunk
        chunks: list[DecodeAttn] = []
        start, widest = 0, 0
        for j, (_, used, _) in enumerate(decode):
            if j > start and (j - start + 1) * max(widest, len(used)) > limit:
                chunks.append(self._decode_chunk(decode[start:j], kv))
                start, widest = j, 0
            widest = max(widest, len(used))
        if decode:
            chunks.append(self._decode_chunk(decode[start:], kv))
        return tuple(chunks)

    def _decode_chunk(
        self, part: list[tuple[int, tuple[int, ...], int]], kv: PagedKV
    ) -> DecodeAttn:
        """One chunk: block tables padded to the longest (with the sequence's first block)
        and an additive mask over the padded positions when lengths differ."""
        dev = self.device
        width = max(len(used) for _, used, _ in part)
        blocks = [b for _, used, _ in part for b in (*used, *(used[0],) * (width - len(used)))]
        ctxs = [ctx for _, _, ctx in part]
        max_ctx = max(ctxs)
        mask = None
        if min(ctxs) < max_ctx:
            pad = torch.arange(max_ctx).unsqueeze(0) >= torch.tensor(ctxs).unsqueeze(1)
            mask = torch.zeros(pad.shape, dtype=self.dtype).masked_fill_(pad, float("-inf"))
            mask = mask[:, None, None, :].to(dev)
        lengths = torch.tensor(ctxs, dtype=torch.long) if dev.type == "cpu" else None
        group = PagedGroup(
            len(part), torch.tensor(blocks, dtype=torch.long).to(dev), width, max_ctx, mask, lengths
        )
        rows = [row for row, _, _ in part]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return DecodeAttn(slice(rows[0], rows[0] + len(rows)), group)
        return DecodeAttn(torch.tensor(rows, dtype=torch.long).to(dev), group)

    def _rope_tables(
        self, batch: BatchInput, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (first half negated, see :func:`apply_rope`) ``[T, 1, head_dim]``
        in the model dtype for ``positions`` ``[T]``.

        Dynamic NTK stretches per sequence by its own length (``start + n``), as transformers
        does for one sequence generating with a cache.
        """
        pos = positions.to(self.device).to(torch.float32)
        rs = self.arch.rope_scaling
        if rs is not None and rs.kind is RopeKind.DYNAMIC:
            per_seq = [
                self.arch.rope_inv_freq(s.end)[0].expand(len(s.token_ids), -1) for s in batch.seqs
            ]
            inv = torch.cat(per_seq).to(self.device)
            freqs = pos.unsqueeze(1) * inv
        else:
            freqs = pos.unsqueeze(1) * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos = (emb.cos() * self._rope_scale).to(self.dtype)
        sin = emb.sin() * self._rope_scale
        sin[..., : sin.shape[-1] // 2].neg_()
        return cos, sin.to(self.dtype)
