/* Runs a small Lua program with the freshly built library: proof the compile produced working code. */
#include <stdio.h>
#include "lua.h"
#include "lauxlib.h"
#include "lualib.h"

int main(void) {
    lua_State *L = luaL_newstate();
    luaL_openlibs(L);
    const char *prog = "local s = 0 for i = 1, 100000 do s = s + i % 7 end return s";
    if (luaL_dostring(L, prog) != LUA_OK) {
        fprintf(stderr, "lua error: %s\n", lua_tostring(L, -1));
        return 1;
    }
    printf("lua=%lld\n", (long long)lua_tointeger(L, -1));
    lua_close(L);
    return 0;
}
