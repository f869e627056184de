"""NOT vLLM: the few vLLM names kvstrata's CUDA staging imports, for a GPU machine where vLLM
0.32.0 cannot be installed (benchmarks/README.md, "device/"). KVCacheLayout is vLLM 0.32.0's file verbatim;
the copy op is vLLM 0.32.0's own compiled library, taken from its wheel by prepare.sh."""

__version__ = "0.32.0+kvstrata-device-shim"
