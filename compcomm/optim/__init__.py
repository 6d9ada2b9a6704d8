"""1-bit optimizers built on compcomm.compressed_allreduce."""
