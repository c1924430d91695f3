// A step of a whole decoder stack in one call (`torch.classes.ladle_cpu.DecodeStack`), for models whose
// projections are all quantized (engine_server/layers/decode_stack.py builds it).
//
// From Python, a decode step of SmolLM2-135M is ~300 small op calls (30 layers x norms, projections, rope, KV
// write, attention, activation), each paying a few microseconds of Python and dispatcher overhead: about a third
// of a single-stream token on a 2-core CPU. This class runs the same sequence of the same kernels (ops.h) from
// C++, so its result is bit-identical to the layers' (`engine_server/layers/decoder.py`) on every step:
//   per layer: h, r = add_rms_norm(h, r) (rms_norm on layer 0, r = h); qkv = linear(h) (+ bias);
//   q, k = q_norm(q), k_norm(k) where the layer has them (Qwen3: ladle_kernels/reference.py's rms_norm, op for op, as
//   the layers run it on [T, heads, D]; OLMoE: rms_norm over the whole of q and of k, then q, k and v clamped
//   with clip_qkv); q, k = rotary(q, k); K/V written to their slots;
//   a = paged_decode_attention(q) (over the layer's window); h, r = add_rms_norm(o_proj(a), r);
//   then a dense layer's h = down(silu_and_mul(gate_up(h))), or a mixture of experts' (engine_server/layers/moe.py
//   over quantized experts): its router's logits (rowwise_linear), softmax, top-k (renormalised if asked),
//   h = moe_packed(h, ...) (+ sigmoid(shared gate) * the shared expert's down(silu_and_mul(gate_up(h))))
//   then h = add_rms_norm(h, r) with the final norm.
// Gemma's block (set_gemma_block): h, r = add_rms_norm(rms_norm(o_proj(a), post_attn), r) with pre_ff's weight,
// then h = post_ff(down(gelu_tanh(gate) * up)), with the windowed layers' rope from their own table and the
// attention's scores soft-capped where the model does (Gemma 2). Rope turns each head's first rotary_dim dims alone
// where the model says (Phi-3; the positions given are LongRoPE's table rows), none on SmolLM3's NoPE layers, and
// Granite's outputs are scaled by its residual multiplier before each residual add; Ministral 3's queries by their
// position's temperature before rope. Cohere's parallel blocks (set_parallel_blocks): s = h + r, h = ln(s),
// h = o_proj(attn(h)) + mlp(h), r = s, with its LayerNorm (weight, no bias) for every norm. OLMo 2's post-norm
// blocks (set_post_norm_block): s = h + r, s += post_attn(o_proj(attn(s))), h = post_ff(mlp(s)), r = s.
// Every row is one new token with its own block table and length, so a prompt token is a row too (its sequence's
// table, its position + 1: the layers' by-token attention).
// A step can be stopped between two layers: `forward`'s optional `stop` flag (an int32 tensor another thread may
// set at any time) is read after each layer, and once it is non-zero the call returns a tensor of no rows at once,
// having written the K/V of the layers it ran (engine_server/step_interrupt.py: the caller runs the step again).
// Under tensor parallelism on the CPU (`set_all_reduce`) each rank's stack holds its slices of the projections and
// sums o_proj's and down's outputs over the ranks between them, with the steps of the shared-memory all-reduce
// (engine_server/parallel/shm_all_reduce.py) on its buffers and its call count: the layers' sums, bit for bit.
// LoRA adapters (engine_server/lora): with the slots' weights registered (`set_lora`) and each token's slot passed
// to `forward`, each projection's output gets its adapters' update right after the base linear (qkv before the
// split, o before the all-reduce, gate_up before the activation, down on its output) through `LayerLora.add`'s
// kernel calls in its order: one lora_shrink, then one lora_expand per segment the step's adapters change.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <sched.h>
#include <time.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

// One packed weight for packed_linear (pack_q4 / pack_q8, or engine_server/layers/lowbit_weight.py's pack_lowbit),
// `out_features` rows.
struct Packed {
  at::Tensor packed, scales, mins;
  int64_t out_features;
};

// y = x W^T (+ bias) as engine_server/layers/quantized_linear.py's `QuantizedLinear` computes it: W one packed
// weight, or the shards of a fused projection stored in different formats, their products concatenated.
struct Linear {
  std::vector<Packed> parts;
  at::Tensor bias;

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    if (parts.size() == 1) {
      y = ladle_cpu::packed_linear(x, parts[0].packed, parts[0].scales, parts[0].mins, parts[0].out_features);
    } else {
      std::vector<at::Tensor> packed, scales, mins;
      std::vector<int64_t> rows;
      for (const Packed& p : parts) {
        packed.push_back(p.packed);
        scales.push_back(p.scales);
        mins.push_back(p.mins);
        rows.push_back(p.out_features);
      }
      y = ladle_cpu::packed_linear_parts(x, packed, scales, mins, rows);
    }
    return bias.defined() ? y + bias : y;
  }
};

// ladle_kernels/reference.py's rms_norm of a float32 tensor, op for op: the layers' q/k norms ([T, heads, D]).
at::Tensor reference_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return weight * (x * at::rsqrt(x.pow(2).mean(-1, true) + eps));
}

// A mixture of experts' block over quantized experts (`SparseMoE` with `QuantizedExperts` and `RowwiseLinear`
// routers), before its all-reduce.
struct Experts {
  at::Tensor router;  // [E, H] float32
  at::Tensor w13, w13_scales, w13_mins, w2, w2_scales, w2_mins;
  int64_t intermediate = 0, top_k = 0;
  bool renormalize = false;
  at::Tensor shared_gate;  // [1, H] float32, with a shared expert (Qwen2-MoE)
  int64_t shared_gate_up = -1, shared_down = -1;  // its projections (indices into DecodeStack::linears_)
};

// The fused projections adapters change, in engine_server/lora/targets.py's PROJECTIONS order: a projection's
// index p in `set_lora`, and its segments' bits 4p.. of `forward`'s `lora_segments`.
enum Projection : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kProjections = 4 };
constexpr int64_t kMaxSegments = 4;

// A block of a projection's output columns, [offset, offset + b.size(2)), updated from rank block `part` alone
// (engine_server/lora/targets.py's `Segment`); `b` [S, R, n] is B transposed and scaled, per slot.
struct LoraSegment {
  at::Tensor b;
  int64_t offset, part;
};

// One layer's projection's LoRA slots (engine_server/lora/slots.py's `LoraSlots`): `a` [S, P * rank, in] and the
// segments' B. The tensors are the slots' own, not copies: the runner loads adapters into them between steps.
struct Lora {
  at::Tensor a;
  std::vector<LoraSegment> segments;
  int64_t rank = 0;

  // out (the base projection of x) += each row's adapter update in place, as `LayerLora.add`: nothing unless a
  // segment's bit is set in `mask`; else one shrink, then an expand per set segment in order.
  void add(const at::Tensor& x, const at::Tensor& out, const at::Tensor& slots, int64_t mask) const {
    if (!a.defined() || (mask & ((int64_t{1} << segments.size()) - 1)) == 0) return;
    const at::Tensor y = ladle_cpu::lora_shrink(x, a, slots);
    for (size_t s = 0; s < segments.size(); ++s) {
      if (((mask >> s) & 1) == 0) continue;
      const LoraSegment& segment = segments[s];
      const at::Tensor columns = out.narrow(1, segment.offset, segment.b.size(2));
      ladle_cpu::lora_expand(columns, y.narrow(1, segment.part * rank, rank), segment.b, slots);
    }
  }
};

// A step's adapters: each token's slot (-1: none) and the (projection, segment) bits to run. Undefined slots: none.
struct StepLora {
  at::Tensor slots;
  int64_t segments = 0;

  void add(const Lora& lora, Projection projection, const at::Tensor& x, const at::Tensor& out) const {
    if (slots.defined()) lora.add(x, out, slots, segments >> (kMaxSegments * projection));
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  int64_t qkv, o, gate_up, down;  // indices into DecodeStack::linears_ (gate_up and down -1 with experts)
  int64_t window;                 // the attention's sliding window (0: none)
  at::Tensor q_norm, k_norm;      // Qwen3's per-head norms, OLMoE's whole-projection ones, or undefined
  double qk_eps = 0.0;
  bool qk_norm_whole = false;
  double clip_qkv = 0.0;  // q, k and v clamped to [-clip_qkv, clip_qkv] after the norms (0: not)
  std::optional<Experts> experts;
  std::array<Lora, kProjections> lora;  // undefined (no `a`) where no adapter slots were registered
  // Gemma's block (set_gemma_block): the attention's output normalised (post_norm) before its residual add, the
  // MLP's input normalised by pre_ff_norm and its output by post_ff_norm; undefined for the pre-norm block.
  at::Tensor pre_ff_norm, post_ff_norm;
  bool gelu = false;        // the dense MLP's gate through GELU's tanh form (GeGLU) instead of SiLU
  bool local_rope = false;  // rope from the windowed layers' own table (Gemma 2 and 3: set_local_rope)
  double softcap = 0.0;     // attention scores soft-capped (Gemma 2; 0: not)
  bool rope = true;         // rope on q and k (SmolLM3's NoPE layers: none; set_layer_options)
  // The queries scaled by their position before rope (set_query_temperature): temperatures[floor((p + offset) /
  // floor)], Ministral 3's; undefined for none.
  at::Tensor temperatures;
  int64_t temperature_floor = 1, temperature_offset = 0;
  double residual_multiplier = 1.0;  // each output scaled before its residual add (Granite's; set_layer_options)
  bool post_norm_block = false;  // OLMo 2's block (set_post_norm_block): no pre-norms, outputs normalised
};

// x (a contiguous float32 CPU tensor) summed over the ranks in place: engine_server/parallel/shm_all_reduce.py's
// `ShmAllReduce.all_reduce_sum`, step for step. `counters` is that end's: [0] the call count both ends advance,
// then this end's calls, bytes and nanoseconds.
// How long a rank waiting for the others spins (yielding the core) before it naps between looks, and the nap: with
// a core per rank the others arrive within the spin, and a step pays nothing; with more ranks than cores (or other
// work on them), a rank that spun on would take a core from the very rank it waits for.
constexpr auto kSpinBeforeNapping = std::chrono::microseconds(50);
constexpr timespec kNap{0, 50'000};

// Returns once `*counter` >= `call` (another process's release store).
void wait_until_arrived(const int64_t* counter, int64_t call) {
  if (__atomic_load_n(counter, __ATOMIC_ACQUIRE) >= call) return;
  const auto nap_from = std::chrono::steady_clock::now() + kSpinBeforeNapping;
  while (__atomic_load_n(counter, __ATOMIC_ACQUIRE) < call) {
    if (std::chrono::steady_clock::now() < nap_from) {
      sched_yield();
    } else {
      nanosleep(&kNap, nullptr);
    }
  }
}

struct ShmAllReduce {
  at::Tensor slots;     // [2, size, capacity] float32, in shared memory
  at::Tensor arrivals;  // [size] int64, in shared memory: each rank's last call
  at::Tensor counters;  // [4] int64, this rank's
  int64_t rank = 0;

  bool defined() const { return slots.defined(); }

  void operator()(at::Tensor& x) const {
    const auto started = std::chrono::steady_clock::now();
    const int64_t size = slots.size(1), capacity = slots.size(2), n = x.numel();
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "all-reduce of a contiguous float32 tensor");
    LADLE_CHECK(n <= capacity, "all-reduce of %lld values: a slot holds %lld", static_cast<long long>(n),
                static_cast<long long>(capacity));
    int64_t* count = counters.data_ptr<int64_t>();
    const int64_t call = ++count[0];
    const float* bank = slots.data_ptr<float>() + (call % 2) * size * capacity;
    float* mine = const_cast<float*>(bank) + rank * capacity;
    float* out = x.data_ptr<float>();
    std::memcpy(mine, out, n * sizeof(float));
    int64_t* arrived = arrivals.data_ptr<int64_t>();
    __atomic_store_n(arrived + rank, call, __ATOMIC_RELEASE);
    for (int64_t r = 0; r < size; ++r) {
      wait_until_arrived(arrived + r, call);
    }
    std::memcpy(out, bank, n * sizeof(float));
    for (int64_t r = 1; r < size; ++r) {  // rank order: every rank adds the same values in the same order
      const float* theirs = bank + r * capacity;
      for (int64_t i = 0; i < n; ++i) out[i] += theirs[i];
    }
    count[1] += 1;
    count[2] += n * static_cast<int64_t>(sizeof(float));
    count[3] += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - started)
                    .count();
  }
};

}  // namespace

namespace ladle_cpu {

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              at::Tensor cos_sin_cache, at::Tensor final_norm)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        cos_sin_cache_(cos_sin_cache.contiguous()), final_norm_(final_norm.contiguous()) {}

  // Registers a projection; returns its index for add_layer.
  int64_t add_linear(at::Tensor packed, at::Tensor scales, at::Tensor mins, int64_t out_features,
                     std::optional<at::Tensor> bias) {
    linears_.push_back(Linear{{Packed{packed, scales, mins, out_features}}, bias.value_or(at::Tensor())});
    return static_cast<int64_t>(linears_.size()) - 1;
  }

  // Appends a shard to projection `index` (a fused projection whose shards are in different formats).
  void add_linear_part(int64_t index, at::Tensor packed, at::Tensor scales, at::Tensor mins, int64_t out_features) {
    LADLE_CHECK(index >= 0 && index < static_cast<int64_t>(linears_.size()), "no linear %lld",
                static_cast<long long>(index));
    linears_[index].parts.push_back(Packed{packed, scales, mins, out_features});
  }

  // A layer; gate_up and down -1 for a mixture of experts (`set_experts` next).
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, int64_t qkv, int64_t o, int64_t gate_up,
                 int64_t down, int64_t window) {
    for (int64_t index : {qkv, o}) check_linear(index);
    TORCH_CHECK((gate_up == -1) == (down == -1), "gate_up and down are both projections or both -1 (experts)");
    if (gate_up != -1) {
      check_linear(gate_up);
      check_linear(down);
    }
    TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
    layers_.push_back(Layer{input_norm.contiguous(), post_norm.contiguous(), qkv, o, gate_up, down, window});
  }

  // The last layer's q/k norms: over each head's D values, or with `whole` over all of q and all of k.
  void set_qk_norms(at::Tensor q_norm, at::Tensor k_norm, double eps, bool whole) {
    TORCH_CHECK(!layers_.empty(), "no layer yet");
    const int64_t q_width = whole ? heads_ * head_dim_ : head_dim_, k_width = whole ? kv_heads_ * head_dim_ : head_dim_;
    TORCH_CHECK(q_norm.dim() == 1 && q_norm.size(0) == q_width && k_norm.dim() == 1 && k_norm.size(0) == k_width,
                "q/k norms of the head dim, or with whole of q's and k's widths");
    Layer& layer = layers_.back();
    layer.q_norm = q_norm.contiguous();
    layer.k_norm = k_norm.contiguous();
    layer.qk_eps = eps;
    layer.qk_norm_whole = whole;
  }

  // The last layer as Gemma's block: sandwich norms (its post_norm then normalises the attention's output before
  // the residual add; pre_ff_norm and post_ff_norm the MLP's input and output), GeGLU where `gelu`, its attention
  // scores soft-capped at `softcap` (0: not), rope from the local table (set_local_rope) where `local_rope`.
  void set_gemma_block(std::optional<at::Tensor> pre_ff_norm, std::optional<at::Tensor> post_ff_norm, bool gelu,
                       double softcap, bool local_rope) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().experts.has_value(), "set_gemma_block follows a dense layer");
    TORCH_CHECK(pre_ff_norm.has_value() == post_ff_norm.has_value(), "both feed-forward norms, or neither");
    TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
    TORCH_CHECK(!local_rope || local_cos_sin_cache_.defined(), "set_local_rope before a layer reads it");
    Layer& layer = layers_.back();
    if (pre_ff_norm.has_value()) {
      layer.pre_ff_norm = pre_ff_norm->contiguous();
      layer.post_ff_norm = post_ff_norm->contiguous();
    }
    layer.gelu = gelu;
    layer.softcap = softcap;
    layer.local_rope = local_rope;
  }

  // The last layer as OLMo 2's block: the attention and the MLP read the stream itself, each output normalised
  // (post_norm, then `post_ff_norm`) before its residual add.
  void set_post_norm_block(at::Tensor post_ff_norm) {
    TORCH_CHECK(!layers_.empty(), "no layer yet");
    Layer& layer = layers_.back();
    TORCH_CHECK(!layer.pre_ff_norm.defined() && layer.residual_multiplier == 1.0, "a post-norm block has no more");
    layer.post_ff_norm = post_ff_norm.contiguous();
    layer.post_norm_block = true;
  }

  // The rope table of the layers set_gemma_block marks local (Gemma 2 and 3's windowed layers: their own base).
  void set_local_rope(at::Tensor cos_sin_cache) {
    TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.sizes() == cos_sin_cache_.sizes() &&
                    cos_sin_cache.scalar_type() == cos_sin_cache_.scalar_type(),
                "the local rope table must be shaped as the global one");
    local_cos_sin_cache_ = cos_sin_cache.contiguous();
  }

  // The last layer's rope (off on SmolLM3's NoPE layers) and the scale of its attention's and MLP's outputs before
  // each residual add (Granite's residual_multiplier; 1: none).
  void set_layer_options(bool rope, double residual_multiplier) {
    TORCH_CHECK(!layers_.empty(), "no layer yet");
    layers_.back().rope = rope;
    layers_.back().residual_multiplier = residual_multiplier;
  }

  // The last layer's query temperature by position (Ministral 3's: engine_server/layers/attention.py's
  // `_temperature`): q times temperatures[floor((p + offset) / floor)] after the q/k norms, before rope.
  void set_query_temperature(at::Tensor temperatures, int64_t floor, int64_t offset) {
    TORCH_CHECK(!layers_.empty(), "no layer yet");
    TORCH_CHECK(temperatures.dim() == 1 && temperatures.scalar_type() == at::kFloat, "temperatures: [N] float32");
    TORCH_CHECK(floor >= 1 && offset >= 0, "floor must be >= 1 and offset >= 0");
    Layer& layer = layers_.back();
    layer.temperatures = temperatures.contiguous();
    layer.temperature_floor = floor;
    layer.temperature_offset = offset;
  }

  // Rope over each head's first `rotary_dim` dims alone (Phi-3's partial rotary), the rest passed as they are.
  void set_rotary_dim(int64_t rotary_dim) {
    LADLE_CHECK(rotary_dim > 0 && rotary_dim <= head_dim_ && rotary_dim % 2 == 0, "rotary_dim %lld of head dim %lld",
                static_cast<long long>(rotary_dim), static_cast<long long>(head_dim_));
    rotary_dim_ = rotary_dim;
  }

  // The last layer's clamp of q, k and v (OLMoE's clip_qkv).
  void set_clip_qkv(double clip) {
    TORCH_CHECK(!layers_.empty(), "no layer yet");
    TORCH_CHECK(clip > 0.0, "clip_qkv must be > 0");
    layers_.back().clip_qkv = clip;
  }

  // The last layer's mixture of experts, in place of a dense MLP: its router's float weight [E, H] and the
  // experts' stacked packed weights (`QuantizedExperts`' buffers, in any of moe_packed's formats: 4- and 8-bit,
  // Q5_0 / Q5_1 and the K-quants, gate/up and down each in its own; moe_packed checks them).
  void set_experts(at::Tensor router, at::Tensor w13, at::Tensor w13_scales, at::Tensor w13_mins, at::Tensor w2,
                   at::Tensor w2_scales, at::Tensor w2_mins, int64_t intermediate, int64_t top_k, bool renormalize) {
    TORCH_CHECK(!layers_.empty() && layers_.back().gate_up == -1, "set_experts follows add_layer(..., -1, -1, ...)");
    TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kFloat && router.is_contiguous() &&
                    router.size(0) == w13.size(0),
                "router must be a contiguous [E, H] float32 tensor");
    LADLE_CHECK(top_k >= 1 && top_k <= router.size(0), "top_k %lld of %lld experts", static_cast<long long>(top_k),
                static_cast<long long>(router.size(0)));
    layers_.back().experts =
        Experts{router, w13, w13_scales, w13_mins, w2, w2_scales, w2_mins, intermediate, top_k, renormalize};
  }

  // The last layer's shared expert (after set_experts): its one-output gate's float weight [1, H] and projections.
  void set_shared_expert(at::Tensor gate, int64_t gate_up, int64_t down) {
    TORCH_CHECK(!layers_.empty() && layers_.back().experts.has_value(), "set_shared_expert follows set_experts");
    TORCH_CHECK(gate.dim() == 2 && gate.size(0) == 1 && gate.scalar_type() == at::kFloat && gate.is_contiguous(),
                "the shared expert's gate must be a contiguous [1, H] float32 tensor");
    check_linear(gate_up);
    check_linear(down);
    Experts& experts = *layers_.back().experts;
    experts.shared_gate = gate;
    experts.shared_gate_up = gate_up;
    experts.shared_down = down;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Tensor parallelism: o_proj's and down's outputs are summed over the ranks (ShmAllReduce above, whose fields
  // these are). Without it the stack is one rank's whole model.
  void set_all_reduce(at::Tensor slots, at::Tensor arrivals, at::Tensor counters, int64_t rank) {
    TORCH_CHECK(slots.dim() == 3 && slots.size(0) == 2 && slots.scalar_type() == at::kFloat && slots.is_contiguous(),
                "slots must be a contiguous [2, size, capacity] float32 tensor");
    TORCH_CHECK(arrivals.dim() == 1 && arrivals.size(0) == slots.size(1) && arrivals.scalar_type() == at::kLong,
                "arrivals must be a [size] int64 tensor");
    TORCH_CHECK(counters.numel() == 4 && counters.scalar_type() == at::kLong && counters.is_contiguous(),
                "counters must be a contiguous [4] int64 tensor");
    LADLE_CHECK(rank >= 0 && rank < slots.size(1), "rank %lld of %lld", static_cast<long long>(rank),
                static_cast<long long>(slots.size(1)));
    reduce_ = ShmAllReduce{slots, arrivals, counters, rank};
  }

  // Layer `layer`'s LoRA slots for `projection` (Projection above): a [S, P * rank, in] and, per segment, its b
  // [S, rank, n] added to output columns [offset, offset + n) from rank block `part`; all contiguous float32 and
  // held, not copied. A mixture of experts' layer takes none on gate_up and down (the layers adapt no experts).
  void set_lora(int64_t layer, int64_t projection, at::Tensor a, std::vector<at::Tensor> bs,
                std::vector<int64_t> offsets, std::vector<int64_t> parts, int64_t rank) {
    LADLE_CHECK(layer >= 0 && layer < num_layers(), "no layer %lld", static_cast<long long>(layer));
    LADLE_CHECK(projection >= 0 && projection < kProjections, "no projection %lld", static_cast<long long>(projection));
    const Layer& target = layers_[layer];
    const std::array<int64_t, kProjections> linears{target.qkv, target.o, target.gate_up, target.down};
    const int64_t linear = linears[projection];
    TORCH_CHECK(linear != -1, "a mixture of experts' layer takes no LoRA on gate_up or down");
    TORCH_CHECK(a.dim() == 3 && a.scalar_type() == at::kFloat && a.is_contiguous() && a.device().is_cpu(),
                "a must be a contiguous [S, P * R, in] float32 CPU tensor");
    const int64_t segments = static_cast<int64_t>(bs.size());
    TORCH_CHECK(segments >= 1 && segments <= kMaxSegments && offsets.size() == bs.size() && parts.size() == bs.size(),
                "one to four segments, each with a b, an offset and a part");
    LADLE_CHECK(rank >= 1 && a.size(1) % rank == 0, "a's %lld ranks are not blocks of rank %lld",
                static_cast<long long>(a.size(1)), static_cast<long long>(rank));
    int64_t out_features = 0;
    for (const Packed& part : linears_[linear].parts) out_features += part.out_features;
    Lora lora{a, {}, rank};
    for (int64_t s = 0; s < segments; ++s) {
      const at::Tensor& b = bs[s];
      TORCH_CHECK(b.dim() == 3 && b.scalar_type() == at::kFloat && b.is_contiguous() && b.device().is_cpu() &&
                      b.size(0) == a.size(0) && b.size(1) == rank,
                  "each b must be a contiguous [S, R, n] float32 CPU tensor of a's slots");
      LADLE_CHECK(offsets[s] >= 0 && offsets[s] + b.size(2) <= out_features && parts[s] >= 0 &&
                      (parts[s] + 1) * rank <= a.size(1),
                  "segment %lld: columns [%lld, %lld) of %lld, rank block %lld", static_cast<long long>(s),
                  static_cast<long long>(offsets[s]), static_cast<long long>(offsets[s] + b.size(2)),
                  static_cast<long long>(out_features), static_cast<long long>(parts[s]));
      lora.segments.push_back(LoraSegment{b, offsets[s], parts[s]});
    }
    layers_[layer].lora[projection] = std::move(lora);
    has_lora_ = true;
  }

  // hidden [T, hidden] (the embeddings of the step's tokens) -> the final normalised hidden states [T, hidden];
  // writes the step's K/V into kv_caches (one per layer) at slot_mapping. With `stop` (a one-element int32 CPU
  // tensor), returns a [0, hidden] tensor after the first layer that ends with it non-zero. With `lora_slots` ([T]
  // int32 or int64, each token's adapter slot, -1: none; needs `set_lora`), adds the adapters of the
  // (projection p, segment s) pairs whose bit 4p + s is set in `lora_segments` (-1: all of them).
  at::Tensor forward(at::Tensor hidden, at::Tensor positions, std::vector<at::Tensor> kv_caches,
                     at::Tensor block_tables, at::Tensor seq_lens, at::Tensor slot_mapping,
                     std::optional<at::Tensor> stop, std::optional<at::Tensor> lora_slots,
                     int64_t lora_segments) const {
    LADLE_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer: got %zu for %zu", kv_caches.size(),
                layers_.size());
    TORCH_CHECK(hidden.dim() == 2, "hidden must be [T, hidden]");
    const int64_t tokens = hidden.size(0);
    for (const at::Tensor& cache : kv_caches) {
      TORCH_CHECK(cache.dim() == 5 && cache.sizes() == kv_caches[0].sizes(), "KV caches of one shape, 5-D");
    }
    const int32_t* stop_flag = nullptr;
    if (stop.has_value()) {
      TORCH_CHECK(stop->device().is_cpu() && stop->scalar_type() == at::kInt && stop->numel() == 1,
                  "stop must be a one-element int32 CPU tensor");
      stop_flag = stop->data_ptr<int32_t>();
    }
    StepLora lora;
    if (lora_slots.has_value()) {
      TORCH_CHECK(has_lora_, "LoRA slots given to a stack that holds no adapters' weights (set_lora)");
      TORCH_CHECK(lora_slots->dim() == 1 && lora_slots->size(0) == tokens && lora_slots->device().is_cpu() &&
                      (lora_slots->scalar_type() == at::kLong || lora_slots->scalar_type() == at::kInt),
                  "lora_slots must be a [T] int32 or int64 CPU tensor");
      lora = StepLora{*lora_slots, lora_segments};
    }
    // Another thread writes the flag while this runs (without the GIL): an atomic read of a plain int.
    const auto stopped = [stop_flag] { return stop_flag != nullptr && __atomic_load_n(stop_flag, __ATOMIC_RELAXED); };
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (parallel_) {  // Cohere's: the stream is the last layer's output plus its stream, then its LayerNorm
        residual = i == 0 ? hidden : hidden + residual;
        hidden = cohere_layer_norm(residual, layer.input_norm);
      } else if (layer.post_norm_block) {  // OLMo 2's: the attention reads the stream itself
        residual = i == 0 ? hidden : hidden + residual;
        hidden = residual;
      } else if (i == 0) {
        residual = hidden;
        hidden = rms_norm(hidden, layer.input_norm, eps_);
      } else {
        std::tie(hidden, residual) = add_rms_norm(hidden, residual, layer.input_norm, eps_);
      }
      const at::Tensor qkv = linears_[layer.qkv](hidden);
      lora.add(layer.lora[kQkv], kQkv, hidden, qkv);
      at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
      at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
      if (layer.q_norm.defined() && layer.qk_norm_whole) {  // the layers' rms_norm of 2-D rows: this kernel
        q = rms_norm(q, layer.q_norm, layer.qk_eps);
        k = rms_norm(k, layer.k_norm, layer.qk_eps);
      }
      if (layer.clip_qkv > 0.0) {
        q = at::clamp(q, -layer.clip_qkv, layer.clip_qkv);
        k = at::clamp(k, -layer.clip_qkv, layer.clip_qkv);
        v = at::clamp(v, -layer.clip_qkv, layer.clip_qkv);
      }
      q = q.reshape({tokens, heads_, head_dim_});
      k = k.reshape({tokens, kv_heads_, head_dim_});
      v = v.reshape({tokens, kv_heads_, head_dim_});
      if (layer.q_norm.defined() && !layer.qk_norm_whole) {
        q = reference_rms_norm(q, layer.q_norm, layer.qk_eps);
        k = reference_rms_norm(k, layer.k_norm, layer.qk_eps);
      }
      if (layer.temperatures.defined()) {  // as the layers index their table: the same rows, the same products
        const at::Tensor steps = at::div(positions + layer.temperature_offset, layer.temperature_floor, "floor");
        q = q * layer.temperatures.index({steps}).unsqueeze(-1).unsqueeze(-1);
      }
      if (layer.rope) {
        std::tie(q, k) = rope(positions, q, k, layer.local_rope ? local_cos_sin_cache_ : cos_sin_cache_);
      } else {  // (rope's outputs are new tensors: without it, q is still a view of qkv's rows)
        q = q.contiguous();
      }
      write_kv_cache(k, v, kv_caches[i], slot_mapping);
      const at::Tensor attention = paged_decode_attention(q, kv_caches[i], block_tables, seq_lens, scale_,
                                                          layer.window, layer.softcap, std::nullopt);
      const at::Tensor attended = attention.view({tokens, q_size});
      at::Tensor projected = linears_[layer.o](attended);
      lora.add(layer.lora[kO], kO, attended, projected);
      if (reduce_.defined()) reduce_(projected);
      if (parallel_) {  // the MLP reads the attention's input: the layer's output is their sum
        at::Tensor mlp = dense_mlp(layer, hidden, lora);
        if (reduce_.defined()) reduce_(mlp);
        hidden = projected + mlp;
        if (stopped()) return hidden.new_empty({0, hidden.size(1)});
        continue;
      }
      if (layer.post_norm_block) {  // the stream plus the normalised output; the MLP reads that stream
        residual = residual + rms_norm(projected, layer.post_norm, eps_);
        at::Tensor out = layer.experts ? mixture(*layer.experts, residual) : dense_mlp(layer, residual, lora);
        if (reduce_.defined()) reduce_(out);
        hidden = rms_norm(out, layer.post_ff_norm, eps_);
        if (stopped()) return hidden.new_empty({0, hidden.size(1)});
        continue;
      }
      const bool sandwich = layer.pre_ff_norm.defined(), scaled = layer.residual_multiplier != 1.0;
      if (sandwich) {  // Gemma's: the output normalised (and scaled), then added to the stream and normalised
        at::Tensor normed = rms_norm(projected, layer.post_norm, eps_);
        if (scaled) normed = normed * layer.residual_multiplier;
        std::tie(hidden, residual) = add_rms_norm(normed, residual, layer.pre_ff_norm, eps_);
      } else {
        if (scaled) projected = projected * layer.residual_multiplier;
        std::tie(hidden, residual) = add_rms_norm(projected, residual, layer.post_norm, eps_);
      }
      hidden = layer.experts ? mixture(*layer.experts, hidden) : dense_mlp(layer, hidden, lora);
      if (reduce_.defined()) reduce_(hidden);
      if (sandwich) hidden = rms_norm(hidden, layer.post_ff_norm, eps_);
      if (scaled) hidden = hidden * layer.residual_multiplier;
      if (stopped()) return hidden.new_empty({0, hidden.size(1)});
    }
    TORCH_CHECK(residual.defined(), "the stack has no layers");
    if (parallel_) return cohere_layer_norm(hidden + residual, final_norm_);
    return std::get<0>(add_rms_norm(hidden, residual, final_norm_, eps_));
  }

  // Every layer as Cohere's parallel block (`set_parallel_blocks`): h += attn(ln(h)) + mlp(ln(h)), one LayerNorm
  // (weight, no bias) reading the stream for both, the final norm that LayerNorm too.
  void set_parallel_blocks() {
    for (const Layer& layer : layers_) {
      TORCH_CHECK(!layer.experts.has_value() && !layer.pre_ff_norm.defined() && layer.residual_multiplier == 1.0,
                  "parallel blocks are dense, without sandwich norms or multipliers");
    }
    parallel_ = true;
  }

 private:
  void check_linear(int64_t index) const {
    LADLE_CHECK(index >= 0 && index < static_cast<int64_t>(linears_.size()), "no linear %lld",
                static_cast<long long>(index));
  }

  // engine_server/layers/norm.py's LayerNorm (Cohere's, transformers' CohereLayerNorm) op for op in float32:
  // weight * (x - mean(x)) * rsqrt(var(x) + eps), the variance the mean of the centred squares.
  at::Tensor cohere_layer_norm(const at::Tensor& x, const at::Tensor& weight) const {
    const at::Tensor centred = x - x.mean(-1, true);
    const at::Tensor variance = centred.pow(2).mean(-1, true);
    return weight * (centred * at::rsqrt(variance + eps_));
  }

  // engine_server/layers/attention.py's rope: over the whole head, or over its first rotary_dim_ dims (each turned
  // as a contiguous copy, the rest concatenated after).
  std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos_sin_cache) const {
    if (rotary_dim_ == head_dim_) return rotary_embedding(positions, q, k, cos_sin_cache);
    const int64_t rest = head_dim_ - rotary_dim_;
    auto [q_turned, k_turned] = rotary_embedding(positions, q.narrow(-1, 0, rotary_dim_).contiguous(),
                                                 k.narrow(-1, 0, rotary_dim_).contiguous(), cos_sin_cache);
    return {at::cat({q_turned, q.narrow(-1, rotary_dim_, rest)}, -1),
            at::cat({k_turned, k.narrow(-1, rotary_dim_, rest)}, -1)};
  }

  // engine_server/layers/mlp.py's GatedMLP.partial with SiLU: down(silu_and_mul(gate_up(x))), each projection
  // with the step's adapters.
  at::Tensor dense_mlp(const Layer& layer, const at::Tensor& x, const StepLora& lora) const {
    const at::Tensor gate_up = linears_[layer.gate_up](x);
    lora.add(layer.lora[kGateUp], kGateUp, x, gate_up);
    // GeGLU as the layers run it: torch's tanh GELU of the gate's half (ladle_kernels/reference.py), times the up
    const std::vector<at::Tensor> halves = layer.gelu ? gate_up.chunk(2, -1) : std::vector<at::Tensor>{};
    const at::Tensor gated = layer.gelu ? at::gelu(halves[0], "tanh") * halves[1] : silu_and_mul(gate_up);
    at::Tensor out = linears_[layer.down](gated);
    lora.add(layer.lora[kDown], kDown, gated, out);
    return out;
  }

  // engine_server/layers/moe.py's SparseMoE.forward before its all-reduce: route(), the experts, the shared one.
  at::Tensor mixture(const Experts& e, const at::Tensor& x) const {
    const at::Tensor probs = at::softmax(rowwise_linear(x, e.router), -1);
    auto [weights, chosen] = at::topk(probs, e.top_k, -1);
    if (e.renormalize) weights = weights / weights.sum(-1, true);
    at::Tensor out = moe_packed(x, chosen, weights, e.w13, e.w13_scales, e.w13_mins, e.w2, e.w2_scales, e.w2_mins,
                                e.intermediate);
    if (e.shared_gate.defined()) {
      const at::Tensor shared = linears_[e.shared_down](silu_and_mul(linears_[e.shared_gate_up](x)));
      // As the layers' SparseMoE: each row's gate by sigmoid_mul, whose bits do not depend on the batch.
      out = out + sigmoid_mul(shared, rowwise_linear(x, e.shared_gate).expand_as(shared).contiguous());
    }
    return out;
  }

  int64_t heads_, kv_heads_, head_dim_;
  int64_t rotary_dim_ = head_dim_;  // the dims rope turns (set_rotary_dim)
  double eps_, scale_;
  at::Tensor cos_sin_cache_, final_norm_;
  at::Tensor local_cos_sin_cache_;  // the windowed layers' own rope table (set_local_rope), or undefined
  std::vector<Linear> linears_;
  std::vector<Layer> layers_;
  ShmAllReduce reduce_;
  bool has_lora_ = false;  // some layer's projection has LoRA slots (set_lora)
  bool parallel_ = false;  // Cohere's parallel blocks and LayerNorms (set_parallel_blocks)
};

}  // namespace ladle_cpu

TORCH_LIBRARY_FRAGMENT(ladle_cpu, m) {
  m.class_<ladle_cpu::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor>())
      .def("add_linear", &ladle_cpu::DecodeStack::add_linear)
      .def("add_linear_part", &ladle_cpu::DecodeStack::add_linear_part)
      .def("add_layer", &ladle_cpu::DecodeStack::add_layer)
      .def("set_qk_norms", &ladle_cpu::DecodeStack::set_qk_norms)
      .def("set_clip_qkv", &ladle_cpu::DecodeStack::set_clip_qkv)
      .def("set_gemma_block", &ladle_cpu::DecodeStack::set_gemma_block)
      .def("set_local_rope", &ladle_cpu::DecodeStack::set_local_rope)
      .def("set_layer_options", &ladle_cpu::DecodeStack::set_layer_options)
      .def("set_rotary_dim", &ladle_cpu::DecodeStack::set_rotary_dim)
      .def("set_query_temperature", &ladle_cpu::DecodeStack::set_query_temperature)
      .def("set_parallel_blocks", &ladle_cpu::DecodeStack::set_parallel_blocks)
      .def("set_post_norm_block", &ladle_cpu::DecodeStack::set_post_norm_block)
      .def("set_experts", &ladle_cpu::DecodeStack::set_experts)
      .def("set_shared_expert", &ladle_cpu::DecodeStack::set_shared_expert)
      .def("num_layers", &ladle_cpu::DecodeStack::num_layers)
      .def("set_all_reduce", &ladle_cpu::DecodeStack::set_all_reduce)
      .def("set_lora", &ladle_cpu::DecodeStack::set_lora)
      .def("forward", &ladle_cpu::DecodeStack::forward, "",
           {torch::arg("hidden"), torch::arg("positions"), torch::arg("kv_caches"), torch::arg("block_tables"),
            torch::arg("seq_lens"), torch::arg("slot_mapping"), torch::arg("stop") = torch::arg::none(),
            torch::arg("lora_slots") = torch::arg::none(), torch::arg("lora_segments") = int64_t{-1}});
}
