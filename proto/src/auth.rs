//! Bearer tokens in gRPC metadata.
//!
//! Every RPC carries `authorization: Bearer <token>`. Clients attach it with
//! [`BearerInterceptor`]; the coordinator reads it back with [`bearer_token`].

use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Metadata key the token travels under.
pub const AUTHORIZATION: &str = "authorization";

/// Adds the bearer token to every outgoing request.
#[derive(Clone)]
pub struct BearerInterceptor {
    value: Option<AsciiMetadataValue>,
}

impl std::fmt::Debug for BearerInterceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token itself.
        f.debug_struct("BearerInterceptor")
            .field("has_token", &self.value.is_some())
            .finish()
    }
}

impl BearerInterceptor {
    /// `None` sends no token (the server answers UNAUTHENTICATED).
    pub fn new(token: Option<&str>) -> Result<Self, crate::ValidationError> {
        let value = match token {
            None => None,
            Some(token) => Some(
                format!("Bearer {}", token.trim())
                    .parse::<AsciiMetadataValue>()
                    .map_err(|_| {
                        crate::ValidationError::new(
                            "token",
                            "contains characters not allowed in a header",
                        )
                    })?,
            ),
        };
        Ok(Self { value })
    }
}

impl Interceptor for BearerInterceptor {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.value {
            request.metadata_mut().insert(AUTHORIZATION, value.clone());
        }
        Ok(request)
    }
}

/// The bearer token of a request, if it carries a well-formed one.
pub fn bearer_token(metadata: &MetadataMap) -> Option<&str> {
    let value = metadata.get(AUTHORIZATION)?.to_str().ok()?;
    let token = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))?
        .trim();
    (!token.is_empty()).then_some(token)
}
