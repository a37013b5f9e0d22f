// Inside the Parquet reader: the page header, shared by the Thrift reader
// (parquet_thrift.cpp) and the page decoder (parquet_pages.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace stoker::format::parquet::detail {

enum PageType : int32_t { kDataPage = 0, kIndexPage = 1, kDictionaryPage = 2, kDataPageV2 = 3 };

// parquet.thrift's PageHeader, with the one page header it holds flattened into it.
struct PageHeader {
  int32_t type = -1;
  int32_t uncompressed_page_size = -1;
  int32_t compressed_page_size = -1;
  uint64_t header_size = 0;  // the header's own bytes, before the page body
  bool has_data_v1 = false, has_data_v2 = false, has_dictionary = false;
  int32_t num_values = -1;  // data page v1 or v2, or dictionary page
  int32_t encoding = -1;
  int32_t definition_level_encoding = -1;                                        // v1
  int32_t repetition_level_encoding = -1;                                        // v1
  int32_t num_nulls = 0, num_rows = -1;                                          // v2
  int32_t definition_levels_byte_length = 0, repetition_levels_byte_length = 0;  // v2
  bool is_compressed = true;                                                     // v2
};

// The page header at `data` (`size` bytes to the end of the chunk). FormatErrors name
// `path`, `offset` (the header's file offset) and start with `context`.
PageHeader parse_page_header(const uint8_t* data, uint64_t size, const std::string& path,
                             uint64_t offset, const std::string& context);

}  // namespace stoker::format::parquet::detail
