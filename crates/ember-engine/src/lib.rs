//! ember-engine
