"""Who am I (`GET /me`), and the admins' API tokens (`/admin/tokens`: create, list, revoke).

A token's secret is in one answer only, the one that creates it (service.auth stores its hash)."""

from __future__ import annotations

from fastapi import APIRouter, status

from api.deps import ADMIN_RESPONSES, AuthDep, CurrentUser
from api.limits import TokenId
from api.schemas import TokenCreate, TokenCreated, TokenPublic, TokensPublic, UserPublic, error_responses
from service import auth as access

router = APIRouter(tags=["auth"])


@router.get("/me", response_model=UserPublic)
def whoami(user: CurrentUser) -> UserPublic:
    """The request's user: its token's, or the local user while auth is not required."""
    return UserPublic(user=user.name, admin=user.admin)


@router.post(
    "/admin/tokens",
    status_code=status.HTTP_201_CREATED,
    response_model=TokenCreated,
    responses={**ADMIN_RESPONSES, **error_responses(400, 422)},
)
def create_token(request: TokenCreate, auth: AuthDep, user: CurrentUser) -> TokenCreated:
    """Issue a token for `user` (an admin's if `admin`). Its secret is in this answer only: the
    service keeps its SHA-256. From the first token on, every request needs one."""
    access.require_admin(user, action="create API tokens")
    issued = auth.create_token(user=request.user, admin=request.admin)
    return TokenCreated(**TokenPublic.build(issued.token).model_dump(), token=issued.secret)


@router.get("/admin/tokens", response_model=TokensPublic, responses=ADMIN_RESPONSES)
def list_tokens(auth: AuthDep, user: CurrentUser) -> TokensPublic:
    """Every token, revoked ones too, without secrets."""
    access.require_admin(user, action="list API tokens")
    tokens = auth.list_tokens()
    return TokensPublic(data=[TokenPublic.build(token) for token in tokens], count=len(tokens))


@router.delete(
    "/admin/tokens/{token_id}",
    response_model=TokenPublic,
    responses={**ADMIN_RESPONSES, **error_responses(404, 409, 422)},
)
def revoke_token(token_id: TokenId, auth: AuthDep, user: CurrentUser) -> TokenPublic:
    """Revoke a token: it stops working at once (revoking twice is no error). The last active admin
    token cannot be revoked (409): auth stays required whatever is revoked."""
    access.require_admin(user, action="revoke API tokens")
    return TokenPublic.build(auth.revoke_token(token_id))
