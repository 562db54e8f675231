// Built-in model shapes and random weights: `tiny` (seconds on a CPU; the embedded default the
// README's main job and `tpmoe bench` run) and `m3` (the real MiniMax-M3 shapes).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.h"
#include "model/config.h"

namespace tpmoe {

// `layers` overrides the layer count. For m3 without it: the real 60 layers (0-2 dense MLP + full
// attention, 3-59 MoE + sparse attention); with it: that many MoE + sparse-attention layers, the kind
// that makes up 57 of the real model's 60.
ModelConfig preset_config(const std::string& name, std::optional<int> layers = std::nullopt);

// Random weights for `config`, named as layout A names them, in `dtype` (BF16, F32 or F8_E4M3).
// F8_E4M3 gives an MXFP8 checkpoint: the quantizable linears (attention and indexer projections,
// dense MLPs, routed and shared experts) are the bf16 values quantized by quantize_mxfp8, each with
// its "_scale_inv" sibling; everything else is bf16; `config.quantization` must say mxfp8
// (set_mxfp8 does that). Values come
// from a counter-based hash of (seed, tensor name, index), so any device can generate the same
// numbers independently. Matrices: uniform with std 0.02; norm offsets std 0.1; router bias std 0.01.
std::map<std::string, io::OwnedTensor> random_weights(const ModelConfig& config, uint64_t seed,
                                                      DType dtype = DType::kBF16);

// MXFP8 quantization of a [.., K] tensor (K % 32 == 0): each run of 32 consecutive values gets the
// smallest power-of-two scale 2^(S-127) that keeps its largest magnitude within e4m3's 448, and the
// values are rounded to e4m3 (nearest even). Returns the F8_E4M3 tensor and its U8 scale [.., K/32].
std::pair<io::OwnedTensor, io::OwnedTensor> quantize_mxfp8(const std::vector<int64_t>& shape,
                                                           std::span<const float> values);

// Marks `config` as an MXFP8 checkpoint (quantization_config as the hub files write it).
void set_mxfp8(ModelConfig& config);

// The value random_weights puts at `index` of a tensor whose name hashes to `tensor_key`:
// uniform in [-sqrt(3) std, sqrt(3) std].
float random_value(uint64_t seed, uint64_t tensor_key, uint64_t index, float stddev);
uint64_t tensor_key(const std::string& name);

}  // namespace tpmoe
