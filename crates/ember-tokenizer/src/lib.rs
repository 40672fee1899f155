//! ember-tokenizer
