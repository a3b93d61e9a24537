// x @ W.T for W kept as GGUF blocks (gguf_linear.cpp); each output summed in one fixed order.
#pragma once
#include <torch/extension.h>

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d);
