#include "bindings.hpp"
#include "stoker/image/image.hpp"
#include "stoker/text/ascii_int.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "stoker's C++ core: the shard reader, the index parsers and the CUDA shim";
  m.attr("__version__") = STOKER_VERSION;
  // Before any binding names their codes (stoker._core.Codec, the reader's checks).
  stoker::image::register_decoders();
  stoker::text::register_decoders();
  stoker::bindings::register_errors(m);
  stoker::bindings::register_arrays(m);   // before the FileTable that holds ArrayLayouts
  stoker::bindings::register_columns(m);  // and ColumnLayouts
  stoker::bindings::register_reader(m);
  stoker::bindings::register_ring(m);
  stoker::bindings::register_formats(m);
  stoker::bindings::register_cuda(m);
  stoker::bindings::register_plan(m);
  stoker::bindings::register_image(m);
  stoker::bindings::register_tiff(m);
  stoker::bindings::register_parquet(m);
}
