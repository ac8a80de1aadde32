#include "dtype_codes.h"

#include <stdexcept>
#include <string>

namespace dpp_wire {

namespace {
struct Pair {
  c10::ScalarType torch_type;
  DType wire;
};
const Pair kPairs[] = {
    {c10::ScalarType::Bool, DType::kBool},
    {c10::ScalarType::Byte, DType::kUInt8},
    {c10::ScalarType::Char, DType::kInt8},
    {c10::ScalarType::Short, DType::kInt16},
    {c10::ScalarType::Int, DType::kInt32},
    {c10::ScalarType::Long, DType::kInt64},
    {c10::ScalarType::UInt16, DType::kUInt16},
    {c10::ScalarType::UInt32, DType::kUInt32},
    {c10::ScalarType::UInt64, DType::kUInt64},
    {c10::ScalarType::Half, DType::kFloat16},
    {c10::ScalarType::BFloat16, DType::kBFloat16},
    {c10::ScalarType::Float, DType::kFloat32},
    {c10::ScalarType::Double, DType::kFloat64},
    {c10::ScalarType::ComplexHalf, DType::kComplex32},
    {c10::ScalarType::ComplexFloat, DType::kComplex64},
    {c10::ScalarType::ComplexDouble, DType::kComplex128},
    {c10::ScalarType::Float8_e4m3fn, DType::kFloat8E4M3FN},
    {c10::ScalarType::Float8_e5m2, DType::kFloat8E5M2},
    {c10::ScalarType::Float8_e4m3fnuz, DType::kFloat8E4M3FNUZ},
    {c10::ScalarType::Float8_e5m2fnuz, DType::kFloat8E5M2FNUZ},
};
}  // namespace

int32_t wire_dtype_of(c10::ScalarType type) {
  for (const auto& pair : kPairs) {
    if (pair.torch_type == type) return static_cast<int32_t>(pair.wire);
  }
  throw std::invalid_argument(std::string("dtype ") + c10::toString(type) +
                              " has no wire code; send it as a supported dtype (e.g. view as uint8)");
}

c10::ScalarType scalar_type_of(int32_t wire_code) {
  for (const auto& pair : kPairs) {
    if (static_cast<int32_t>(pair.wire) == wire_code) return pair.torch_type;
  }
  throw std::invalid_argument("unknown wire dtype code " + std::to_string(wire_code));
}

}  // namespace dpp_wire
