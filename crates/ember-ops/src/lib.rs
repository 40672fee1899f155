//! ember-ops
