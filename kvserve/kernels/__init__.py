"""Native CPU kernels (C++, JIT-built with torch.utils.cpp_extension) for attention and sampling."""
