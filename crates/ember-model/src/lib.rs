//! ember-model
