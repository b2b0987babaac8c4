// Byte sizes as people write and read them: "4GiB", "512MiB", "25%" in, "1.50 MiB" out.
#pragma once

#include <cstdint>
#include <string>

#include "expertd/result.h"

namespace expertd {

// The machine's RAM (the base of "25%" sizes).
uint64_t physical_memory_bytes();

// Parses "4GiB", "512MiB", "1.5G", "4096", "2GB" (powers of 1000 for KB/MB/GB/TB, of 1024
// otherwise) or "25%" of `total_bytes`. The error names `what` and the value
// ("cache '4XB': unknown unit (examples: 4GiB, 512MiB, 25%)").
Result<uint64_t> parse_size(const std::string& what, const std::string& value,
                            uint64_t total_bytes);

// "512 B", "1.50 MiB", "2.00 GiB".
std::string human_bytes(uint64_t bytes);

}  // namespace expertd
