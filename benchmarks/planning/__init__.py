"""The planner: planning and search speed, strategy quality, the interleaved step estimates."""
