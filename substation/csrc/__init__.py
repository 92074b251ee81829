"""C++ and CUDA headers included by the generated code (package data)."""
