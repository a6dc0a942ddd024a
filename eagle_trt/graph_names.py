"""The names of the exported graphs' inputs and outputs: their contract with every runtime (ONNX
Runtime, TensorRT, Triton). The exporter (export/) and the runtime (runtime/) both import them
from here, a module with no imports, so the runtime never imports the exporter (nor torch and
onnx through it) for a name, and a graph cache's key (codehash.py) follows only the code that
makes the graphs.

target:        input_ids [B,T] i64, position_ids [B,T] i64, attention_mask [B,T,P+T] bool,
               logits_index [K] i64 (positions that get logits), past_key_{i}, past_value_{i} [B,Hkv,P,D]
           ->  logits [B,K,V], captured [B,T,A*H], accept_path [B,K] i64, accept_length [B] i64,
               accept_tokens [B,K] i64, new_key_{i}, new_value_{i} [B,Hkv,T,D]
               (a sequence's past rows beyond its own length are masked out in attention_mask;
               accept_*: greedy acceptance over the K logits rows, their input_ids and the mask's
               new-row block as the tree (verify.accept_greedy_batch): the accepted path, root
               first, its length (the tokens the call adds) and its tokens (accepted drafts, then
               the bonus). For a prefill (K = 1, the last row) that is the greedy next token.)
drafter tree:  captured [B,T,A*Ht], input_ids [B,T] i64, past_key, past_value [B,Hkv,P,D],
               past_lengths [B] i64 (valid past rows), new_lengths [B] i64 (valid new rows, >= 1)
           ->  tree_tokens [B,N] i64, tree_parents [B,N+1] i64, tree_mask [B,N+1,N+1] bool,
               tree_depths [B,N+1] i64, tree_scores [B,N] f32, new_key, new_value [B,Hkv,T,D]
drafter step:  hidden [1,T,W], input_ids, position_ids [1,T], attention_mask [1,T,P+T], past_key,
               past_value -> logits [1,T,Vd], feedback [1,T,H], new_key, new_value
               (W = A*Ht for the first step, which applies fc; W = H for later steps)
target, fused attention (export/cpu_attention.py, ONNX Runtime's CPU provider): the target's
               inputs, with past_key_{i}, past_value_{i} [B,Hkv,S,D] each sequence's whole block of
               S cache rows; present_key_{i}, present_value_{i} (the same memory, written in place:
               a sequence's new rows right after its committed ones) instead of new_key_{i}, new_value_{i}.
               Its 4-bit form with int8 activations pads a one-row call (a second KV row written
               after the new one: a cache needs room for it) and is lossless for chain trees only;
               its metadata says so (PADS_ONE_ROW, LOSSLESS_TREES)
iteration:     the drafter tree graph's names prefixed with PREFIX, then the target graph's, plus
               VERIFY_NODES in and HANDOFF out (export/iteration.py)
"""
from __future__ import annotations

ACCEPT_OUTPUTS = ["accept_path", "accept_length", "accept_tokens"]

DRAFT_TREE_INPUTS = ["captured", "input_ids", "past_key", "past_value", "past_lengths", "new_lengths"]
DRAFT_TREE_OUTPUTS = ["tree_tokens", "tree_parents", "tree_mask", "tree_depths", "tree_scores",
                      "new_key", "new_value"]

DRAFT_STEP_INPUTS = ["hidden", "input_ids", "position_ids", "attention_mask", "past_key", "past_value"]
DRAFT_STEP_OUTPUTS = ["logits", "feedback", "new_key", "new_value"]

# The iteration graph (export/iteration.py): the drafter tree graph's names carry PREFIX
PREFIX = "drafter."
HANDOFF = ("next_captured", "next_input_ids")   # the next call's drafter.captured and drafter.input_ids
VERIFY_NODES = "verify_nodes"   # [1] i64: how many of the tree's best nodes the call verifies

# Graph metadata (ONNX metadata_props) the runtime reads: "1" where the graph pads a one-row call to
# two rows inside itself, and the tree shapes whose speculative output is the graph's own greedy
# decoding ("chains": top_k 1 only; absent: any)
PADS_ONE_ROW = "eagle_trt.pads_one_row"
LOSSLESS_TREES = "eagle_trt.lossless_trees"

# Each KV cache's (past key, past value, new key, new value) names: per target layer, the drafter's one
DRAFTER_KV_NAMES = ("past_key", "past_value", "new_key", "new_value")


def target_kv_names(num_layers: int, in_place: bool = False) -> list[tuple[str, str, str, str]]:
    """in_place: the fused-attention graph's, whose outputs are the caches written in place."""
    new = "present" if in_place else "new"
    return [(f"past_key_{i}", f"past_value_{i}", f"{new}_key_{i}", f"{new}_value_{i}") for i in range(num_layers)]


def target_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "position_ids", "attention_mask", "logits_index"]
    outputs = ["logits", "captured", *ACCEPT_OUTPUTS]
    for past_key, past_value, new_key, new_value in target_kv_names(num_layers):
        inputs += [past_key, past_value]
        outputs += [new_key, new_value]
    return inputs, outputs


def kv_heads_and_dim(shape, source: str) -> tuple[int, int]:
    """(Hkv, D) of a KV input's declared shape [B, Hkv, rows, D]. Graphs exported before format
    7 put the rows before the heads ([B, rows, Hkv, D]); they are refused, not misread."""
    if len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in (shape[1], shape[3])):
        raise ValueError(f"{source}: KV input shape {list(shape)} is not [batch, kv_heads, rows, head_dim]: the "
                         f"graph was exported by an older eagle_trt (rows before heads); re-export it "
                         f"(python -m eagle_trt.build --force export)")
    return int(shape[1]), int(shape[3])
