// Chains in C++: the forward and I of a stage of Linears and elementwise
// activations (fastpipe/runtime/chain.py says which stages and why), run
// with the GIL released.
//
// Why native: issued from Python, each of the stage's aten ops pays the
// binding's argument parsing and tensor wrapping (~3-5 us), and, in local
// mode, hands the GIL over to the other ranks' threads and waits to get it
// back. On the narrow benchmark stage (4 MLP blocks, d=128, 16 microbatches
// of 4 rows) forward and backward took 15.2 ms through autograd, 12.3 ms as
// ops from Python and 9.1-9.8 ms from here (7.5-8.6 ms with the GELU kernel
// below). The ops and their operands are those of chain.py, so the paths
// agree bit for bit, but for GELU in fp32 and bf16 (see gelu()).
//
// Built only where torch's headers are at build time (setup.py); fastpipe
// falls back to chain.py's ops when this module does not load.
#include <ATen/native/Gelu.h>
#ifdef FASTPIPE_GELU_STUB
#include <ATen/TensorIterator.h>
#include <ATen/native/Activation.h>
#endif
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include "defer.h"
#include "wgrad.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace fastpipe {
namespace {

namespace py = pybind11;

// chain.py's op codes.
enum Kind : std::int64_t { kLinear = 0, kGelu, kSilu, kRelu, kTanh, kSigmoid };

struct Op {
  std::int64_t kind;
  at::Tensor weight;  // Linear only
  std::optional<at::Tensor> bias;
  at::native::GeluType gelu = at::native::GeluType::None;  // GELU only
  std::shared_ptr<Layer> work;  // Linear only: its W this step (a WeightLayer)
};

// What a forward keeps for backward: one tensor per op (input or output).
struct Saved {
  std::vector<at::Tensor> tensors;
};

// W's share of one microbatch: (op index, incoming gradient, input) per Linear.
bool needs_grad(const std::optional<at::Tensor>& t) { return t.has_value() && t->requires_grad(); }

// mm_mat1_backward for x @ w.t(): a column-major input gets a column-major gradient.
at::Tensor input_grad(const at::Tensor& g, const at::Tensor& w, const at::Tensor& x) {
  if (x.stride(0) == 1 && x.stride(1) == x.size(0)) return w.t().mm(g.t()).t();
  return g.mm(w);
}

// GELU and its gradient through ATen's own vectorized CPU kernels, the
// ones at::gelu runs for fp64 or with oneDNN off. For fp32 and bf16
// at::gelu hands the op to oneDNN, whose per-call set-up dominates at the
// sizes pipelines see: on [4, 512] fp32, one thread, 9.4 us forward and
// 25 us backward through oneDNN, 2.5 and 4.5 us here (a narrow 2-rank 1F1B
// step went 17.1 -> 14.3 ms). The two kernels differ in the last bits
// (within 5e-7 on unit inputs), so a chain is bit-identical to autograd run
// with torch.backends.mkldnn disabled, and within rounding of it otherwise.
// Built without FASTPIPE_GELU_STUB (setup.py defines it on x86-64 only),
// a chain calls at::gelu as autograd does.
#ifdef FASTPIPE_GELU_STUB
constexpr bool kAtenGelu = true;

at::Tensor gelu(const at::Tensor& x, at::native::GeluType type) {
  TORCH_CHECK(x.is_cpu(), "chains run on CPU tensors");
  at::Tensor out;
  auto iter = at::TensorIterator::unary_op(out, x);
  at::native::GeluKernel(at::kCPU, iter, type);
  return iter.output();
}

at::Tensor gelu_backward(const at::Tensor& g, const at::Tensor& x, at::native::GeluType type) {
  at::Tensor out;
  auto iter = at::TensorIterator::borrowing_binary_op(out, g, x);
  at::native::GeluBackwardKernel(at::kCPU, iter, type);
  return iter.output();
}
#else
constexpr bool kAtenGelu = false;

at::Tensor gelu(const at::Tensor& x, at::native::GeluType type) {
  return at::gelu(x, at::native::gelutype_to_string(type));
}

at::Tensor gelu_backward(const at::Tensor& g, const at::Tensor& x, at::native::GeluType type) {
  return at::gelu_backward(g, x, at::native::gelutype_to_string(type));
}
#endif

// A stage's ops. The structure stays for the stage's life;
// the parameters are bound for one step (bind .. unbind), so that between
// steps nothing here holds them (torch.utils.swap_tensors needs that).
class Program {
 public:
  explicit Program(const std::vector<std::int64_t>& kinds) {
    for (std::size_t i = 0; i < kinds.size(); ++i) {
      TORCH_CHECK(kinds[i] >= kLinear && kinds[i] <= kSigmoid, "unknown op code ", kinds[i]);
      ops_.push_back(Op{kinds[i], at::Tensor(), std::nullopt});
      if (kinds[i] == kLinear && first_linear_ < 0) first_linear_ = static_cast<std::int64_t>(i);
    }
    TORCH_CHECK(first_linear_ >= 0, "a chain needs a Linear");
  }

  // `layers`: each Linear's WeightLayer this step, in op order (what its
  // calls' W runs with: deferred.linear_work).
  void bind(const std::vector<std::optional<at::Tensor>>& weights, const std::vector<std::optional<at::Tensor>>& biases,
            const std::vector<std::string>& approximate, const std::vector<std::shared_ptr<Layer>>& layers) {
    TORCH_CHECK(weights.size() == ops_.size() && biases.size() == ops_.size() && approximate.size() == ops_.size(),
                "weights, biases and approximate need one entry per op");
    std::size_t linears = 0;
    for (const Op& op : ops_) linears += op.kind == kLinear;
    TORCH_CHECK(layers.size() == linears, "layers: one WeightLayer per Linear (", linears, "), got ", layers.size());
    std::size_t next = 0;
    for (std::size_t i = 0; i < ops_.size(); ++i) {
      TORCH_CHECK(ops_[i].kind != kLinear || weights[i].has_value(), "op ", i, ": a Linear needs its weight");
      ops_[i].weight = weights[i].value_or(at::Tensor());
      ops_[i].bias = biases[i];
      if (ops_[i].kind == kGelu) ops_[i].gelu = at::native::get_gelutype_enum(approximate[i]);
      if (ops_[i].kind == kLinear) {
        TORCH_CHECK(layers[next] && layers[next]->kind == kLinear, "op ", i, ": not a Linear's WeightLayer");
        ops_[i].work = layers[next++];
      }
    }
    bound_ = true;
  }

  void unbind() {
    for (Op& op : ops_) {
      op.weight = at::Tensor();
      op.bias = std::nullopt;
      op.work.reset();
    }
    bound_ = false;
  }

  std::pair<at::Tensor, std::shared_ptr<Saved>> forward(const at::Tensor& x) const {
    TORCH_CHECK(bound_, "no parameters bound: call bind first");
    auto saved = std::make_shared<Saved>();
    at::Tensor h;
    {
      py::gil_scoped_release nogil;
      at::NoGradGuard no_grad;
      saved->tensors.reserve(ops_.size());
      h = x;
      for (const Op& op : ops_) {
        switch (op.kind) {
          case kLinear:
            saved->tensors.push_back(h);
            h = at::linear(h, op.weight, op.bias);
            break;
          case kGelu:
            saved->tensors.push_back(h);
            h = gelu(h, op.gelu);
            break;
          case kSilu:
            saved->tensors.push_back(h);
            h = at::silu(h);
            break;
          default:
            h = op.kind == kRelu ? at::relu(h) : op.kind == kTanh ? at::tanh(h) : at::sigmoid(h);
            saved->tensors.push_back(h);
        }
      }
    }
    return {h, saved};
  }

  // I: the gradient of the stage input (None unless need_input) and W's
  // share: a call (WeightLayer, input, incoming gradient) of each trained
  // Linear, last op first, for deferred weight gradients
  // (fastpipe/runtime/deferred.py) to run.
  std::pair<std::optional<at::Tensor>, std::shared_ptr<Calls>> backward_input(Saved& saved, const at::Tensor& grad,
                                                                              bool need_input) const {
    TORCH_CHECK(bound_, "no parameters bound: call bind first");
    TORCH_CHECK(saved.tensors.size() == ops_.size(), "this forward's tensors were used already");
    auto items = std::make_shared<Calls>();
    std::optional<at::Tensor> out;
    {
      py::gil_scoped_release nogil;
      at::NoGradGuard no_grad;
      at::Tensor g = grad;
      for (std::int64_t i = static_cast<std::int64_t>(ops_.size()) - 1; i >= 0; --i) {
        const Op& op = ops_[i];
        const at::Tensor& s = saved.tensors[i];
        if (op.kind == kLinear) {
          if (op.weight.requires_grad() || needs_grad(op.bias)) items->calls.push_back({op.work, s, g});
          if (i == first_linear_ && !need_input) break;  // what lies below only leads to the input
          g = input_grad(g, op.weight, s);
          continue;
        }
        switch (op.kind) {
          case kGelu:
            g = gelu_backward(g, s, op.gelu);
            break;
          case kSilu:
            g = at::silu_backward(g, s);
            break;
          case kRelu:
            g = at::threshold_backward(g, s, 0);
            break;
          case kTanh:
            g = at::tanh_backward(g, s);
            break;
          default:
            g = at::sigmoid_backward(g, s);
        }
      }
      if (need_input) out = g;
    }
    saved.tensors.clear();  // with the GIL: the input may be a tensor Python holds
    return {out, std::move(items)};
  }

  // Bytes a forward keeps, counted as fastpipe.runtime.memory counts
  // autograd's (a tensor two ops save, an activation's output and the next
  // Linear's input, counts once), so both paths report alike.
  std::int64_t saved_bytes(const Saved& saved) const {
    std::int64_t total = 0;
    std::set<std::pair<const void*, std::int64_t>> seen;
    for (const at::Tensor& t : saved.tensors) {
      const auto n = static_cast<std::int64_t>(t.nbytes());
      if (seen.emplace(t.data_ptr(), n).second) total += n;
    }
    return total;
  }

 private:
  std::vector<Op> ops_;
  std::int64_t first_linear_ = -1;
  bool bound_ = false;
};

// Whether any of these parameters has a gradient accumulator that carries
// hooks (registered on the AccumulateGrad node: DDP's reducer, a
// `p.expand_as(p).grad_fn.next_functions[0][0].register_hook(...)`). Python
// cannot see those; a chain, which accumulates by hand, would skip them.
// Only an accumulator that is alive is looked at: one is made fresh for
// every graph and no hooks can sit on a node nobody holds.
bool accumulator_hooked(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params) {
    if (!p.defined() || !p.requires_grad()) continue;
    auto acc = torch::autograd::impl::try_get_grad_accumulator(p);
    if (acc && (!acc->pre_hooks().empty() || !acc->post_hooks().empty() ||
                !acc->tensor_pre_hooks().empty() || !acc->retains_grad_hooks().empty())) {
      return true;
    }
  }
  return false;
}

}  // namespace
}  // namespace fastpipe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Chains of Linears and activations (forward and I), and deferred weight gradients (W), "
            "without autograd or the GIL.";
  namespace py = pybind11;
  using fastpipe::Program, fastpipe::Saved;
  // What fastpipe/_ext.py's CHAIN_INTERFACE expects: raised with any change
  // to what this module offers, so a build from other sources is not used.
  m.attr("interface") = 2;
  m.attr("aten_gelu") = fastpipe::kAtenGelu;
#ifdef FASTPIPE_BUILT_WITH_TORCH
  m.attr("built_with_torch") = FASTPIPE_BUILT_WITH_TORCH;  // torch.__version__ at build time
#endif
  fastpipe::register_wgrad(m);
  fastpipe::register_defer(m);
  m.def("accumulator_hooked", &fastpipe::accumulator_hooked, py::arg("params"),
        "Whether a live AccumulateGrad node of one of these parameters carries hooks.");
  py::class_<Saved, std::shared_ptr<Saved>>(m, "Saved");
  py::class_<Program>(m, "Program")
      .def(py::init<const std::vector<std::int64_t>&>(), py::arg("kinds"))
      .def("bind", &Program::bind, py::arg("weights"), py::arg("biases"), py::arg("approximate"), py::arg("layers"))
      .def("unbind", &Program::unbind)
      .def("forward", &Program::forward, py::arg("x"))
      .def("backward_input", &Program::backward_input, py::arg("saved"), py::arg("grad"), py::arg("need_input"))
      .def("saved_bytes", &Program::saved_bytes, py::arg("saved"));
}
