//! ember-chat
