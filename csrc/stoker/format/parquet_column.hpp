// A Parquet leaf column as the reader's ColumnLayout sees it: the decoder that
// turns a unit's stored pages into values (parquet.hpp does the decoding).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "stoker/format/parquet.hpp"
#include "stoker/io/column_layout.hpp"

namespace stoker::format::parquet {

class ParquetColumnDecoder final : public io::ColumnDecoder {
 public:
  explicit ParquetColumnDecoder(ColumnSpec spec) : spec_(std::move(spec)) {}
  io::ByteVector decode(const uint8_t* dictionary, uint64_t dictionary_size,
                        uint64_t dictionary_offset, const uint8_t* data, uint64_t size,
                        uint64_t file_offset, uint64_t rows, const std::string& path,
                        io::ValuesLeft left) const override;
  io::ColumnValues view(const io::ByteVector& decoded) const override;
  const ColumnSpec& spec() const { return spec_; }

 private:
  ColumnSpec spec_;
};

}  // namespace stoker::format::parquet
