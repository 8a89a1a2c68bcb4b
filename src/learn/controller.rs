//! Dynamic batch-size controller math (placeholder).
