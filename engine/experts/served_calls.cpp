// moetray::expert_slots on CPU without Python for the calls the slot table serves (see
// engine/experts/resident.py). A compiled decode step calls the operator once a layer; where every
// routed expert has its slot, all it does is return the looked-up slots and keep the call for the
// planner, and doing that in Python took the GIL and a boxed Python call 30 times a step. Here
// such a call is appended to its runtime's log; a call that misses is handed to the Python
// operator moetray::expert_slots_planned, which settles the log and plans the call.
//
// moetray::take_served_calls(runtime) drains a runtime's log as one int64 tensor, each call in the
// order it ran as [layer, tokens, n, expert_1 < ... < expert_n] (its distinct routed experts,
// ascending): the one wire format, read by read_served_calls (ResidentSlots.take).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

std::mutex log_lock;
std::unordered_map<int64_t, std::vector<int64_t>> served_log;  // runtime key → calls, encoded

at::Tensor expert_slots(const at::Tensor& top_k_index, const at::Tensor& looked_up, const at::Tensor& resident,
                        int64_t runtime, int64_t layer) {
  if (!resident.contiguous().data_ptr<bool>()[0]) {
    static auto planned = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("moetray::expert_slots_planned", "")
                              .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
    return planned.call(top_k_index, runtime, layer);
  }
  const at::Tensor routed = top_k_index.contiguous().to(at::kLong);
  const int64_t* ids = routed.data_ptr<int64_t>();
  std::vector<int64_t> experts(ids, ids + routed.numel());
  std::sort(experts.begin(), experts.end());
  experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
  {
    std::lock_guard<std::mutex> hold(log_lock);
    std::vector<int64_t>& log = served_log[runtime];
    log.push_back(layer);
    log.push_back(top_k_index.dim() > 0 ? top_k_index.size(0) : 1);
    log.push_back(static_cast<int64_t>(experts.size()));
    log.insert(log.end(), experts.begin(), experts.end());
  }
  return looked_up.clone();  // an operator's output may not alias its input
}

at::Tensor take_served_calls(int64_t runtime) {
  std::vector<int64_t> log;
  {
    std::lock_guard<std::mutex> hold(log_lock);
    auto found = served_log.find(runtime);
    if (found == served_log.end()) {
      return at::empty({0}, at::kLong);
    }
    log.swap(found->second);
    served_log.erase(found);
  }
  return at::tensor(log, at::kLong);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moetray, m) {
  m.def("take_served_calls(int runtime) -> Tensor", &take_served_calls);
}

TORCH_LIBRARY_IMPL(moetray, CPU, m) {
  m.impl("expert_slots", &expert_slots);
}
