#include "stoker/format/parquet_column.hpp"

#include "stoker/errors.hpp"

namespace stoker::format::parquet {

io::ByteVector ParquetColumnDecoder::decode(const uint8_t* dictionary, uint64_t dictionary_size,
                                            uint64_t dictionary_offset, const uint8_t* data,
                                            uint64_t size, uint64_t file_offset, uint64_t rows,
                                            const std::string& path, io::ValuesLeft left) const {
  if (dictionary_size == 0) {  // a whole column chunk: its dictionary page, if any, first
    return decode_column_chunk(data, size, file_offset, spec_, rows, path, left);
  }
  uint64_t consumed = 0;
  auto entries =
      read_dictionary_page(dictionary, dictionary_size, dictionary_offset, spec_, path, &consumed);
  if (!entries) {
    throw FormatError(path, dictionary_offset,
                      spec_.name + ": the page index's dictionary page is not one");
  }
  return decode_data_pages(data, size, file_offset, spec_, entries.get(), rows, path);
}

io::ColumnValues ParquetColumnDecoder::view(const io::ByteVector& decoded) const {
  DecodedView v = view_decoded(decoded);
  return io::ColumnValues{v.rows, v.offsets, v.nulls, v.data, v.data_size, v.starts};
}

}  // namespace stoker::format::parquet
