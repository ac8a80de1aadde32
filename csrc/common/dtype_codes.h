// torch ScalarType <-> wire DType code.
#pragma once

#include <c10/core/ScalarType.h>

#include "wire_header.h"

namespace dpp_wire {

// Throws std::invalid_argument naming the dtype when the wire format has no code for it.
int32_t wire_dtype_of(c10::ScalarType type);
c10::ScalarType scalar_type_of(int32_t wire_code);

}  // namespace dpp_wire
