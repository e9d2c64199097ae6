//! weir test kit
