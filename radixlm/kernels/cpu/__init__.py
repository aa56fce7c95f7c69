"""Native CPU kernels (C++ built on first use, loaded with ctypes); see build.py and ops.py."""
