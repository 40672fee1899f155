//! ember-cpu
