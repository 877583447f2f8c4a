#pragma once

// The 16-bit float formats weights and tensors may arrive in, widened to float32 exactly: the
// one conversion the safetensors loader and the protocols' FP16/BF16 tensors share.

#include <cstdint>

namespace attnserve::core {

// The float32 value of an IEEE binary16 (FP16) number, exactly (subnormals, infinities and NaN
// payloads included).
float HalfToFloat(uint16_t half);

// The float32 value of a bfloat16 (BF16) number, exactly.
float BFloat16ToFloat(uint16_t bf16);

}  // namespace attnserve::core
