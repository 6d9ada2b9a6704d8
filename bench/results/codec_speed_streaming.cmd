COMPCOMM_BENCH_ROUNDS=15 pytest bench/test_codec_speed.py --benchmark-json bench/results/codec_speed_streaming.json
